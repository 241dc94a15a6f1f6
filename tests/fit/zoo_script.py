"""A user's script training a model of tests/zoo.py with paratrain.Trainer, launched as a user would:
`python -m tests.fit.zoo_script KIND DEVICES STRATEGY OUT.json` from the repository's root. After fit, in the launching process only, it
writes the losses and the trained weights `model` received from the workers."""

from __future__ import annotations

import json
import sys

import paratrain
from paratrain.nn.ties import tied_parameters
from tests import zoo


def main() -> None:
    kind, devices, strategy, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    model = zoo.build(kind)
    trainer = paratrain.Trainer(devices=devices, strategy=strategy, max_steps=4, global_batch=8, lr=1e-3,
                                weight_decay=0.1)
    result = trainer.fit(model, zoo.loss_fn(kind), zoo.data(kind))
    tied = [list(group) for group in tied_parameters(model)]
    with open(out, "a") as file:
        file.write(json.dumps({"losses": list(result.losses.values()), "tied": tied,
                               "model": {k: v.tolist() for k, v in model.state_dict().items()}}) + "\n")


if __name__ == "__main__":
    main()
