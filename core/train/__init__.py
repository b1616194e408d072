"""``speculum train``: self-distillation training of draft heads and draft models.

The target answers training prompts (:mod:`speculum.train.distill`), its hidden states
and outputs become the data (:mod:`speculum.train.data`), and a method's trainer
(:class:`speculum.train.base.Trainer`, registered through the ``speculum_register_trainers``
hook like every other plugin part) learns to predict them; :mod:`speculum.train.loop`
runs it and writes the method's public checkpoint format. This module is a default
plugin: it registers the built-in ``draft`` trainer.
"""

from speculum.hooks import hookimpl
from speculum.train.base import Trainer

__all__ = ["Trainer"]


@hookimpl
def speculum_register_trainers(register):
    register("draft", "speculum.train.draft:DraftTrainer",
             description="a small standalone Llama (target's tokenizer and embeddings) trained on the target's outputs")
