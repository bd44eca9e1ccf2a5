"""The training loop (`engine`) and what one step is made of: the optimizer step, the objective,
the optimizer and LR schedule, the plan of a run, evaluation and early stopping."""
