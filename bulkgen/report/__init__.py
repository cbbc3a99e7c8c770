"""`bulkgen report`: what a job did, as figures (figures.py, the `--json` data), plots (plots.py, matplotlib,
the `report` extra) and one self-contained HTML page (page.py), served live by serve.py."""
