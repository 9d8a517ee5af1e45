"""One training run's loop (trainer.py: the Trainer, the optimizer and schedule, evaluation, metrics), Muon, and the
rules of resume=true; train.py holds the run's schema and builds it."""
