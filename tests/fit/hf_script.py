"""A user's script for paratrain.Trainer(hf=DIR): `python hf_script.py FOLDER DEVICES STRATEGY SAVE OUT RESULT.json`
trains the folder's model (the Trainer launches its own workers), then writes it back as a Hugging Face folder."""

from __future__ import annotations

import json
import sys

import torch

import paratrain


def data(vocab: int) -> torch.utils.data.TensorDataset:
    """16 windows of 9 tokens as (input_ids, labels) items, labels aligned to the inputs."""
    ids = torch.randint(0, vocab, (16, 9), generator=torch.Generator().manual_seed(3))
    return torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])


def fit(folder: str, devices: int, strategy: str, save: str) -> tuple[paratrain.Trainer, paratrain.FitResult]:
    trainer = paratrain.Trainer(devices=devices, strategy=strategy, hf=folder, save=save, max_steps=3, global_batch=8,
                                micro_batch=4 // devices if strategy != "tp" else 4, lr=1e-3)
    vocab = json.loads(open(f"{folder}/config.json").read())["vocab_size"]
    return trainer, trainer.fit(train_data=data(vocab))


if __name__ == "__main__":
    folder, devices, strategy, save, out, result = sys.argv[1:7]
    trainer, done = fit(folder, int(devices), strategy, save)
    trainer.save_pretrained(out, max_shard_size="30KB")
    with open(result, "a") as stream:
        stream.write(json.dumps({"losses": done.losses}) + "\n")
