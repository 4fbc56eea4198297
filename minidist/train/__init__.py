"""The trainer and what it is built from: the strategies behind one interface, each declared once
in a registry (strategies/), models, data, checkpoints, the loop (trainer.py), its launcher
(app.py), config checks, logs and failure reports."""
