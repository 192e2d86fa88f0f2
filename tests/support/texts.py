"""Texts that the tokenizer and protocol tests stream: multi-byte characters that tokens split."""

MULTILINGUAL = "Café naïve — 東京タワー 🚀👍🏽 Ünïcödé, 你好世界! 🇫🇷 done."
