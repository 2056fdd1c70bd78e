"""A Hugging Face ``Trainer`` on Ray Train, guarded by one callback (lines marked ``# guard``).

    python examples/hf_trainer.py                         # a local Ray
    ray job submit --working-dir . -- python examples/hf_trainer.py

A tiny GPT-2 (random weights from ``GPT2Config``, nothing downloaded) learns synthetic tokens on
2 gloo workers, as Ray's Hugging Face guide has it: ``prepare_trainer``, Ray's
``RayTrainReportCallback`` (a checkpoint per save) and a resume from ``get_checkpoint()``.
``raytrain_guard.train.TorchTrainer`` and ``GuardCallback`` add the guard: the steps timed
(data wait, forward, backward, optimizer), the Trainer's DataLoader held to the host budget,
a stop that every rank honours at the same step with a checkpoint, and ``result.guard``.
Needs ``pip install 'raytrain-guard[transformers]'``.
"""

from __future__ import annotations

import os
import sys
import tempfile

import ray
import ray.train
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from raytrain_guard.integrations.transformers import GuardCallback  # guard
from raytrain_guard.train import TorchTrainer  # guard

VOCAB, SEQ = 1024, 32


class Tokens(torch.utils.data.Dataset):
    """``num_samples`` random token rows; token 0 of row ``i`` is ``i`` (a sample's id)."""

    def __init__(self, num_samples: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (num_samples, SEQ), generator=g)
        self.ids[:, 0] = torch.arange(num_samples) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB,
                                      n_positions=SEQ, bos_token_id=0, eos_token_id=0))


def build_trainer(config: dict) -> Trainer:
    """The user's Trainer, as on one machine, plus Ray's callback and the guard's."""
    args = TrainingArguments(
        output_dir=config["output_dir"], per_device_train_batch_size=config["batch_size"],
        max_steps=config["max_steps"], learning_rate=1e-3, logging_steps=10,
        save_strategy="steps" if config.get("save_steps") else "no",
        save_steps=config.get("save_steps") or 500, dataloader_num_workers=1,
        dataloader_prefetch_factor=4, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True)
    trainer = Trainer(model=make_model(), args=args, train_dataset=Tokens(config["samples"]))
    trainer.add_callback(RayTrainReportCallback())
    trainer.add_callback(GuardCallback())                                          # guard
    return prepare_trainer(trainer)


def train(trainer: Trainer) -> None:
    """Train, resuming from the run's latest checkpoint when there is one."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.train()
        return
    with checkpoint.as_directory() as path:
        trainer.train(resume_from_checkpoint=os.path.join(path,
                                                          RayTrainReportCallback.CHECKPOINT_NAME))


def train_func(config: dict) -> None:
    train(build_trainer(config))


def main() -> int:
    if os.environ.get("RAY_ADDRESS"):
        ray.init()                        # ray job submit: the cluster's
    else:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    storage = tempfile.mkdtemp(prefix="rtg-hf-")
    try:
        result = TorchTrainer(
            train_func, train_loop_config={"output_dir": os.path.join(storage, "hf"),
                                           "batch_size": 8, "max_steps": 40, "samples": 640,
                                           "save_steps": 20},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="hf_trainer", storage_path=storage),
        ).fit()
    finally:
        ray.shutdown()
    print(result.guard.format())
    print("done: error" if result.error else "done: trained with the guard")
    return 0


if __name__ == "__main__":
    sys.exit(main())
