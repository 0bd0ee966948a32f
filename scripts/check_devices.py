"""The book's code on every device present, checked against PyTorch and `transformers` there.

    make check-devices                        # every device present: the CPU, CUDA, Apple's MPS
    python scripts/check_devices.py --quick   # small models and few tokens (CI runs this)
    python scripts/check_devices.py --device cuda --out results/

On each device:

1. `MultiHeadAttention.from_torch` and `Transformer.from_torch` against the PyTorch modules
   they copy, with causal and padding masks, in float32 (TF32 off on CUDA);
2. GPT-2- and Llama-shaped checkpoints with random weights, written by `transformers` itself
   (nothing is downloaded), loaded by `load_gpt2` / `load_llama` straight onto the device, against
   `transformers`' own model on that device: the logits, and the greedy tokens of `generate`;
3. the same models in bfloat16: the book's bfloat16 logits must be no further from the float32
   ones than the reference's bfloat16 logits are (within a quarter: ``BFLOAT16_SLACK``);
4. one short training run of a small encoder-decoder on the device, against the same run on the
   CPU (the losses of every step);
5. what each of PyTorch's attention backends returns for a query with no allowed key (zeros,
   NaN, or something else), next to the book's `MultiHeadAttention`, which must return zeros;
6. greedy decoding speed, tokens per second, the book's `generate` against `transformers`'.

It writes ``check-devices.json`` and ``check-devices.md`` into ``--out`` (default
``_build/devices``), and exits with status 1 if any check fails. Chapter 17 shows a GPU's rows
for the key-less query from the JSON of a run committed as
``book/data/devices/check-devices-<device>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the checkpoints are made here
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from utils.attention import MultiHeadAttention  # noqa: E402
from utils.decoding import generate  # noqa: E402
from utils.masks import causal_mask, to_torch_attn_mask  # noqa: E402
from utils.pretrained import load_gpt2, load_llama  # noqa: E402
from utils.transformer import Transformer  # noqa: E402

FULL = {"d_model": 256, "heads": 4, "layers": 4, "vocab": 50257, "prompt": 16,
        "new_tokens": 64, "batches": [1, 8], "train_steps": 40, "repeats": 3}
QUICK = {"d_model": 32, "heads": 2, "layers": 2, "vocab": 101, "prompt": 6,
         "new_tokens": 8, "batches": [1, 2], "train_steps": 8, "repeats": 1}
FLOAT32_BOUND = {"attention": 1e-5, "transformer": 1e-4, "logits": 1e-4}
# The book's bfloat16 logits may be off float32's by at most this many times the reference's own
# bfloat16 error: the same roundings in another order (GPT-2's Conv1D is an addmm, the book's a
# Linear) land elsewhere, not further. Llama's are bit-identical to the reference's.
BFLOAT16_SLACK = 1.25
TRAIN_BOUND = 1e-2  # largest difference of a step's loss from the CPU's (0 on the CPU itself)


def devices_present() -> list[str]:
    """"cpu", then "cuda" and "mps" where PyTorch can use them."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    return found


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    if device == "mps":
        return f"Apple MPS ({platform.machine()})"
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def _row(check: str, value: float | bool | str, bound: float | None, passed: bool,
         note: str = "") -> dict:
    return {"check": check, "value": value, "bound": bound, "passed": bool(passed), "note": note}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ------------------------------------------------------------------------------ from_torch


def check_modules(device: str) -> list[dict]:
    """The book's attention and Transformer against the PyTorch modules they copy."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(ref).to(device)
    ref = ref.to(device)
    x = torch.randn(3, 7, 32, device=device)
    mask = causal_mask(7, device=device)
    with torch.no_grad():
        diff = _max_diff(ours(x, x, x, mask), ref(x, x, x, attn_mask=to_torch_attn_mask(mask),
                                                  need_weights=False)[0])
    rows = [_row("MultiHeadAttention.from_torch, causal, float32", diff,
                 FLOAT32_BOUND["attention"], diff <= FLOAT32_BOUND["attention"])]
    torch.manual_seed(0)
    with warnings.catch_warnings():  # nested tensors are not used with norm_first: said once
        warnings.simplefilter("ignore", UserWarning)
        ref_t = nn.Transformer(32, 4, num_encoder_layers=2, num_decoder_layers=2,
                               dim_feedforward=64, dropout=0.0, batch_first=True,
                               norm_first=True).eval()
    ours_t = Transformer.from_torch(ref_t).to(device)
    ref_t = ref_t.to(device)
    src, tgt = torch.randn(3, 9, 32, device=device), torch.randn(3, 6, 32, device=device)
    src_pad = torch.ones(3, 9, dtype=torch.bool, device=device)
    src_pad[1, 6:] = False  # the second source is padded after 6 positions
    causal = causal_mask(6, device=device)
    with torch.no_grad():
        diff = _max_diff(
            ours_t(src, tgt, src_mask=src_pad, tgt_mask=causal, memory_mask=src_pad),
            ref_t(src, tgt, tgt_mask=~causal, src_key_padding_mask=~src_pad,
                  memory_key_padding_mask=~src_pad))
    rows.append(_row("Transformer.from_torch, padded and causal, float32", diff,
                     FLOAT32_BOUND["transformer"], diff <= FLOAT32_BOUND["transformer"]))
    return rows


# ---------------------------------------------------------------------------- checkpoints


def write_checkpoints(folder: Path, sizes: dict) -> dict[str, Path]:
    """A GPT-2 and a Llama checkpoint with random weights, written by `transformers`."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    d, h, n, v = sizes["d_model"], sizes["heads"], sizes["layers"], sizes["vocab"]
    length = sizes["prompt"] + sizes["new_tokens"]
    configs = {
        "gpt2": transformers.GPT2Config(vocab_size=v, n_embd=d, n_head=h, n_layer=n,
                                        n_positions=length, bos_token_id=v - 1,
                                        eos_token_id=v - 1, initializer_range=0.1),
        "llama": transformers.LlamaConfig(vocab_size=v, hidden_size=d, num_attention_heads=h,
                                          num_key_value_heads=max(1, h // 2),
                                          intermediate_size=2 * d, num_hidden_layers=n,
                                          max_position_embeddings=length, bos_token_id=v - 1,
                                          eos_token_id=v - 1, initializer_range=0.1,
                                          tie_word_embeddings=False),
    }
    classes = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}
    paths = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        paths[name] = folder / name
        classes[name](config).save_pretrained(paths[name], safe_serialization=True)
    return paths


def _models(kind: str, path: Path, device: str, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    import transformers

    cls = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM
    theirs = cls.from_pretrained(path, dtype=dtype).to(device).eval()
    loader = load_gpt2 if kind == "gpt2" else load_llama
    ours = loader(path, dtype=dtype, device=device).eval()
    return ours, theirs


def _greedy_theirs(theirs: nn.Module, prompts: torch.Tensor, new: int, eos: int) -> list:
    out = theirs.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                          do_sample=False, pad_token_id=eos, eos_token_id=eos)
    rows = []
    for row in out[:, prompts.shape[1]:].tolist():
        rows.append(row[: row.index(eos)] if eos in row else row)
    return rows


def check_checkpoints(device: str, paths: dict[str, Path], sizes: dict) -> list[dict]:
    """The loaders' logits and greedy tokens in float32, and their bfloat16 error."""
    rows = []
    eos = sizes["vocab"] - 1
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, eos, (2, sizes["prompt"]), generator=g).to(device)
    for kind, path in paths.items():
        ours, theirs = _models(kind, path, device, torch.float32)
        with torch.no_grad():
            ref32 = theirs(tokens).logits
            diff = _max_diff(ours(tokens), ref32)
        rows.append(_row(f"{kind}: load onto {device}, logits, float32", diff,
                         FLOAT32_BOUND["logits"], diff <= FLOAT32_BOUND["logits"]))
        with torch.inference_mode():
            same = generate(ours, tokens, sizes["new_tokens"], eos=eos) == _greedy_theirs(
                theirs, tokens, sizes["new_tokens"], eos)
        rows.append(_row(f"{kind}: greedy tokens, {sizes['new_tokens']} new, float32", same,
                         None, same))
        del ours, theirs
        ours, theirs = _models(kind, path, device, torch.bfloat16)
        with torch.no_grad():
            ref16 = theirs(tokens).logits
            ours16 = ours(tokens)
        own_error, error, apart = (_max_diff(ref16, ref32), _max_diff(ours16, ref32),
                                   _max_diff(ours16, ref16))
        bound = BFLOAT16_SLACK * own_error
        rows.append(_row(f"{kind}: bfloat16 logits, error against float32", error, bound,
                         error <= bound,
                         f"bound: {BFLOAT16_SLACK} x the reference's own bfloat16 error, "
                         f"{own_error:.2e}; the two bfloat16 runs differ by {apart:.2e}"))
    return rows


# ------------------------------------------------------------------------------- training


def _training_losses(device: str | None, steps: int) -> list[float]:
    from utils import seed_everything
    from utils.models import Seq2SeqTransformer
    from utils.tasks import ReversalTask
    from utils.train import token_cross_entropy, train

    task = ReversalTask(max_len=8)
    seed_everything(0)
    v = len(task.vocab)
    model = Seq2SeqTransformer(v, v, d_model=32, nhead=4,
                               num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64,
                               norm_first=True)

    def loss(model: nn.Module, batch: object) -> torch.Tensor:
        logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
        return token_cross_entropy(logits, batch.tgt_out)

    history = train(model, task.batches(16, seed=0, pad_to=10), loss, steps=steps, lr=3e-3,
                    print_fn=None, device=device)
    return history.step_losses


def check_training(device: str, steps: int) -> list[dict]:
    on_cpu = _training_losses(None, steps)
    here = _training_losses(device, steps)
    diff = max(abs(a - b) for a, b in zip(on_cpu, here, strict=True))
    bound = 0.0 if device == "cpu" else TRAIN_BOUND
    return [_row(f"training, {steps} steps on {device}: largest loss difference from the "
                 "CPU's run (device=None)", diff, bound,
                 diff <= bound and all(map(math.isfinite, here)))]


# --------------------------------------------------------------------- all-masked queries


def check_all_masked_rows(device: str) -> list[dict]:
    """PyTorch's attention backends, and the book's module, on a query with no allowed key."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    rows = []
    dtype = torch.float32 if device == "cpu" else torch.float16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 16, generator=g).to(device, dtype) for _ in range(3))
    allowed = torch.ones(4, 4, dtype=torch.bool, device=device)
    allowed[2] = False  # query 2 may see no key
    for backend in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                out = scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        except (RuntimeError, AttributeError) as e:
            rows.append(_row(f"PyTorch SDPA {backend.lower()}: a query with no key", "-", None,
                             True, f"not available here ({str(e).splitlines()[0][:60]})"))
            continue
        row = out[0, :, 2]
        biggest = float(row.float().abs().max())
        what = ("NaN" if bool(row.isnan().any()) else
                "zeros" if biggest == 0 else f"not zero (largest |x| {biggest:.2f})")
        rows.append(_row(f"PyTorch SDPA {backend.lower()}, {str(dtype)[6:]}: a query with no key",
                         what, None, True, "what the backend does (not a check)"))
    x = torch.randn(1, 4, 32, generator=g).to(device, dtype)
    for keep_weights, path in ((False, "default (fused) path"), (True, "from-scratch path")):
        # No biases: a query with no key then gets exactly W_O 0 = 0.
        mha = MultiHeadAttention(32, 2, bias=False, keep_weights=keep_weights)
        mha = mha.to(device, dtype).eval()
        with torch.no_grad():
            out = mha(x, x, x, allowed)
        zero = bool((out[0, 2] == 0).all()) and not bool(out.isnan().any())
        rows.append(_row(f"the book's MultiHeadAttention, {path}, {str(dtype)[6:]}: a query "
                         "with no key gets zeros", zero, None, zero))
    return rows


# ------------------------------------------------------------------------------- decoding


def time_decoding(device: str, path: Path, sizes: dict) -> list[dict]:
    """Greedy decoding of the GPT-2 checkpoint, the book's `generate` against `transformers`',
    in tokens per second (the median of ``repeats`` runs after a warm-up)."""
    ours, theirs = _models("gpt2", path, device, torch.float32)
    eos = sizes["vocab"] - 1
    rows = []
    for batch in sizes["batches"]:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, eos, (batch, sizes["prompt"]), generator=g).to(device)
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        made = {}
        runs = {"ours": lambda p=prompts: generate(ours, p, sizes["new_tokens"], eos=eos),
                "theirs": lambda p=prompts: _greedy_theirs(theirs, p, sizes["new_tokens"], eos)}
        with torch.inference_mode():
            for name, run in runs.items():
                made[name] = run()  # warm-up
            for _ in range(sizes["repeats"]):
                for name, run in runs.items():
                    _sync(device)
                    start = time.perf_counter()
                    run()
                    _sync(device)
                    times[name].append(time.perf_counter() - start)
        tokens = sum(len(r) for r in made["ours"])
        per_s = {k: tokens / sorted(t)[len(t) // 2] for k, t in times.items()}
        rows.append({"batch": batch, "tokens": tokens,
                     "same_tokens": made["ours"] == made["theirs"],
                     "ours_tokens_per_s": per_s["ours"], "theirs_tokens_per_s": per_s["theirs"],
                     "speedup": per_s["ours"] / per_s["theirs"]})
    return rows


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


# --------------------------------------------------------------------------------- report


def check_device(device: str, paths: dict[str, Path], sizes: dict) -> dict:
    """Every check of this module on ``device``, and the decoding times."""
    if device == "cuda":  # float32 means float32: no TF32 in the comparisons
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    checks = [*check_modules(device), *check_checkpoints(device, paths, sizes),
              *check_training(device, sizes["train_steps"]), *check_all_masked_rows(device)]
    decoding = time_decoding(device, paths["gpt2"], sizes)
    checks += [_row(f"decoding, batch {r['batch']}: the same tokens as transformers",
                    r["same_tokens"], None, r["same_tokens"]) for r in decoding]
    return {"device": device, "name": device_name(device), "checks": checks,
            "decoding": decoding, "seconds": round(time.perf_counter() - started, 1)}


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.2e}"
    return str(v)


def markdown(result: dict) -> str:
    """The result as Markdown: one table of checks and one of decoding speed per device."""
    lines = [f"# The book's code on {len(result['devices'])} device(s)", "",
             f"{result['date']}; PyTorch {result['torch']}, transformers "
             f"{result['transformers']}; {result['sizes']}.", ""]
    for dev in result["devices"]:
        lines += [f"## {dev['device']}: {dev['name']}", "",
                  "| check | value | bound | passed | note |", "| --- | --- | --- | --- | --- |"]
        for c in dev["checks"]:
            bound = "" if c["bound"] is None else _value(c["bound"])
            lines.append(f"| {c['check']} | {_value(c['value'])} | {bound} | "
                         f"{'yes' if c['passed'] else '**NO**'} | {c['note']} |")
        lines += ["", "| batch | new tokens | the book's generate, tokens/s | transformers, "
                  "tokens/s | ratio |", "| --- | --- | --- | --- | --- |"]
        for r in dev["decoding"]:
            lines.append(f"| {r['batch']} | {r['tokens']} | {r['ours_tokens_per_s']:,.0f} | "
                         f"{r['theirs_tokens_per_s']:,.0f} | {r['speedup']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models and few tokens")
    parser.add_argument("--device", action="append", choices=("cpu", "cuda", "mps"),
                        help="a device to check (repeatable; default: every one present)")
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "devices")
    args = parser.parse_args(argv)
    import transformers

    present = devices_present()
    wanted = args.device or present
    missing = [d for d in wanted if d not in present]
    if missing:
        parser.error(f"not present here: {missing} (present: {present})")
    sizes = QUICK if args.quick else FULL
    result = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "python": platform.python_version(), "quick": args.quick,
              "sizes": (f"d_model {sizes['d_model']}, {sizes['layers']} layers, vocabulary "
                        f"{sizes['vocab']:,}, prompt {sizes['prompt']}, "
                        f"{sizes['new_tokens']} new tokens"),
              "devices": []}
    with tempfile.TemporaryDirectory() as folder:
        paths = write_checkpoints(Path(folder), sizes)
        for device in wanted:
            result["devices"].append(check_device(device, paths, sizes))
    failed = [f"{d['device']}: {c['check']} ({_value(c['value'])}, bound {_value(c['bound'])})"
              for d in result["devices"] for c in d["checks"] if not c["passed"]]
    result["failed"] = failed
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "check-devices.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "check-devices.md").write_text(markdown(result))
    for dev in result["devices"]:
        ok = sum(c["passed"] for c in dev["checks"])
        print(f"{dev['device']} ({dev['name']}): {ok} of {len(dev['checks'])} checks passed in "
              f"{dev['seconds']} s; decoding, tokens/s ours/transformers: " + ", ".join(
                  f"batch {r['batch']} {r['ours_tokens_per_s']:,.0f}/"
                  f"{r['theirs_tokens_per_s']:,.0f}" for r in dev["decoding"]))
    print(f"written: {args.out / 'check-devices.json'}, {args.out / 'check-devices.md'}")
    if failed:
        print("FAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
