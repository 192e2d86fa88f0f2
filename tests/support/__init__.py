"""What several test modules share: fixtures' helpers, tiny models, the local Ray, `serve run`,
the helm binary. Test modules import from here, never from one another."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
