"""The trainer and what it is built from: the strategies behind one interface (strategy.py,
strategy_base.py, deepspeed_strategy.py), models, data, checkpoints, the loop (trainer.py), its
launcher (launch_train.py), config checks, logs and failure reports."""
