"""A tiny Llama trained by transformers' Trainer on a model fsdp() sharded, on 2 CPU ranks.

    torchrun --standalone --nproc-per-node 2 examples/trainer_llama.py [OUTPUT_DIR]

The one line that differs from a plain Trainer script: ``FSDPTrainer`` for ``Trainer``. Checkpoints
every 2 steps, resumes from the first, and saves a folder ``from_pretrained`` loads.
"""

from __future__ import annotations

import sys

import torch
import transformers

from zeta_fsdp import fsdp, shutdown
from zeta_fsdp.integrations.trainer import FSDPTrainer


class Tokens(torch.utils.data.Dataset):
    """Random token sequences standing in for a tokenized corpus."""

    def __init__(self, n: int = 32, seq: int = 16, vocab: int = 128):
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main(output_dir: str = "trainer-out") -> dict:
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4
    )
    torch.manual_seed(0)
    model = fsdp(transformers.LlamaForCausalLM(cfg), auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
    args = transformers.TrainingArguments(
        output_dir,
        use_cpu=True,  # on GPUs: leave out (torchrun sets each rank's device)
        ddp_backend="gloo",
        bf16=True,  # the same precision as fsdp(mp="bf16"): FSDP2's policy alone casts
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        max_grad_norm=1.0,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = FSDPTrainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(8))
    trainer.train()
    trainer.train(resume_from_checkpoint=f"{output_dir}/checkpoint-2")  # restarts at step 2: same end
    metrics = trainer.evaluate()
    trainer.save_model(f"{output_dir}/final")  # every rank: the shards go straight to the files
    return metrics


if __name__ == "__main__":
    print(main(*sys.argv[1:2]))
    shutdown()
