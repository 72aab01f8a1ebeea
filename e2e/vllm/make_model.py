"""Make a tiny Llama model and its tokenizer locally, with nothing fetched from a model hub.

Run with the Python of the vLLM environment (it has torch, transformers and tokenizers):

    <env>/bin/python e2e/vllm/make_model.py TARGET_DIR

* tokenizer: byte-level BPE, 2,048 tokens, trained on the standard library's ``.py``
  files (a fixed, sorted selection, so the vocabulary is the same on every machine),
  with ChatML's special tokens and a ChatML chat template;
* model: ``LlamaForCausalLM``, 2 layers, hidden size 128, 2 attention heads of 64
  (a head size vLLM's CPU attention accepts), random weights from a fixed seed,
  bfloat16: about 0.6 M parameters, 1.2 MB of safetensors.

It answers with random tokens; what the e2e lane needs is a real engine's scheduler,
prefix cache, usage accounting, metrics and endpoints, none of which depend on the
weights.
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 2048
MAX_MODEL_LEN = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TRAINING_FILES = 400


def training_files() -> list[str]:
    stdlib = Path(sysconfig.get_path("stdlib"))
    files = sorted(str(p) for p in stdlib.glob("*.py"))
    return files[:TRAINING_FILES]


def make_tokenizer(target: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(training_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        model_max_length=MAX_MODEL_LEN,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(target)


def make_model(target: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)


def main() -> int:
    target = Path(sys.argv[1])
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    make_tokenizer(staging)
    make_model(staging)
    # Appear whole or not at all: a half-written model directory is never used.
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
