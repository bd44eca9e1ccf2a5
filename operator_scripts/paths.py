"""Where the checkout's files are, for the commands that read the chart and write generated
files: one definition, whichever package asks."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHART_DIR = REPO / "helm"
