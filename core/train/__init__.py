"""``speculum train``: self-distillation training of draft heads and draft models.

The target answers training prompts (:mod:`speculum.train.distill`), its hidden states
and outputs become the data (:mod:`speculum.train.data`), and a method's trainer
(:class:`speculum.train.base.Trainer`, found through the ``speculum.train`` entry point
group) learns to predict them; :mod:`speculum.train.loop` runs it and writes the method's
public checkpoint format.
"""

from speculum.train.base import Trainer

__all__ = ["Trainer"]
