"""Entry point: registers ``eagle`` and ``eagle3`` and detects their checkpoints."""

from speculum import hookimpl
from speculum_eagle.formats import detect
from speculum_eagle.proposer import Eagle3Options, make_eagle, make_eagle3


@hookimpl
def speculum_register_proposers(register):
    register("eagle", make_eagle, backends=("torch",),
             description="EAGLE-1 head over the target's last hidden state; chain drafts with its own KV")
    register("eagle3", make_eagle3, backends=("torch",), options=Eagle3Options,
             description="EAGLE-3 head over fused low/mid/high target features, reduced draft vocabulary")


@hookimpl
def speculum_detect_method(model_path, config):
    return detect(model_path, config)


@hookimpl
def speculum_register_trainers(register):
    """``speculum train eagle/eagle3`` (the training code is imported only when used)."""
    register("eagle", "speculum_eagle.train:EagleTrainer",
             description="EAGLE-1 head: feature regression + token cross-entropy, unrolled over the draft chain")
    register("eagle3", "speculum_eagle.train:Eagle3Trainer",
             description="EAGLE-3 head: fused low/mid/high features, reduced vocabulary, training-time test")
