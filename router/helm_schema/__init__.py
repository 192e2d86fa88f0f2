"""`python -m router.helm_schema`: helm/values.schema.json generated from the config tree
(router/app_config.py's AppConfig, its `engine:` pd_cluster/config.py's EngineConfig), so that
the chart refuses what the application would refuse without a second copy of every field.

tree.py turns the tree's JSON schema into the chart's values (camelCase, moved where the chart
groups them); chart.py is the hand-kept rest (the chart's own values and its rules on the
tree's); generate.py puts them together. No Ray or torch import. It lives in router/, beside
the AppConfig it reads: the engine core (pd_cluster/) imports nothing from the packages above
it.
"""
