"""What the benchmark, the forecast and the tests share, and the reports and checks that stand
alone: the multi-process launcher (``launch``), the parity decoder (``parity_model``), the
model catalogue, JSON and plot output, barrier-started timing; the planner, padding-table and
Muon-balance reports and the GPU check, each ``python -m vescale_plugins.tools.<name>``."""
