"""Submissions of our own for the grader's tests: right ones written in several ways, wrong ones
(one known mistake each) and hostile ones. Each is the source notebook of its assignment with the
solution cells replaced, so that it looks exactly like a handed-in notebook.

``SUBMISSIONS`` maps a student's name to (assignment, {solution cell index: new source},
expectation). The expectation is ``"full"``, ``"zero"``, or a phrase its feedback must hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent

A1_EINSUM = '''
def scaled_dot_product_attention(q, k, v, mask=None):
    scores = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        mask = mask.expand(scores.shape)
        scores = scores.masked_fill(~mask, float("-inf"))
        scores = torch.where(mask.any(-1, keepdim=True), scores, torch.zeros_like(scores))
        weights = torch.softmax(scores, dim=-1) * mask
    else:
        weights = torch.softmax(scores, dim=-1)
    return torch.einsum("...qk,...kd->...qd", weights, v), weights
'''

A1_FLOAT64 = '''
def scaled_dot_product_attention(q, k, v, mask=None):
    dtype = q.dtype
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
        scores = scores.masked_fill(~mask.any(-1, keepdim=True), 0.0)
        weights = torch.softmax(scores, -1) * mask
    else:
        weights = torch.softmax(scores, -1)
    return (weights @ v).to(dtype), weights.to(dtype)
'''


def _a1(body: str) -> str:
    """A function ``scaled_dot_product_attention`` whose scores and weights come from ``body``."""
    return f'''
def scaled_dot_product_attention(q, k, v, mask=None):
    d_k = q.shape[-1]
{body}
'''


A1_BATCH_AXIS = _a1('''    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=0)
    return weights @ v, weights''')
A1_TIMES = _a1('''    scores = q @ k.transpose(-2, -1) * math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
        scores = scores.masked_fill(~mask.any(-1, keepdim=True), 0.0)
        weights = torch.softmax(scores, dim=-1) * mask
    else:
        weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights''')
A1_AFTER = _a1('''    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
        scores = scores.masked_fill(~mask.any(-1, keepdim=True), 0.0)
        weights = torch.softmax(scores, dim=-1) * mask / math.sqrt(d_k)
    else:
        weights = torch.softmax(scores, dim=-1) / math.sqrt(d_k)
    return weights @ v, weights''')
A1_SWAP = _a1('''    k, v = v, k
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
        scores = scores.masked_fill(~mask.any(-1, keepdim=True), 0.0)
        weights = torch.softmax(scores, dim=-1) * mask
    else:
        weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights''')
A1_NAN_GRAD = _a1('''    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    return weights @ v, weights''')
A1_RIGHT = _a1('''    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
        scores = scores.masked_fill(~mask.any(-1, keepdim=True), 0.0)
        weights = torch.softmax(scores, dim=-1) * mask
    else:
        weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights''')
A1_CHEAT = '''
import utils.checks
utils.checks.check_scaled_dot_product_attention = lambda *a, **k: None
print = lambda *a, **k: None
''' + _a1('''    return q, k''')
A1_FAKE_PRINT = '''
import builtins, sys
sys.stdout.write("GRADES {\\"check_scaled_dot_product_attention\\": 1.0}\\n")
sys.stdout.write("[PASS] 10 / 10\\n")
''' + _a1('''    return q, k''')
A1_REFERENCE = '''
from utils.attention import scaled_dot_product_attention
'''
# The fast paths compute the same attention from another module of the book.
A1_FAST_PATH = '''
from utils.fast_attention import memory_efficient_attention


def scaled_dot_product_attention(q, k, v, mask=None):
    return memory_efficient_attention(q, k, v, mask=mask), None
'''
# An import the static scan cannot see: the forked process must refuse it at run time.
A1_HIDDEN_IMPORT = '''
import importlib
scaled_dot_product_attention = importlib.import_module(
    "utils." + "attention").scaled_dot_product_attention
'''
A1_TORCH = _a1('''    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = sdpa(q, k, v, attn_mask=mask)
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d_k), -1)
    return out, w''')
A1_EXIT = "import os\nos._exit(0)\n" + A1_RIGHT
A1_SYS_EXIT = A1_RIGHT + "\nimport sys\nsys.exit(3)\n"
A1_WRITES = A1_RIGHT + '''
open("next_to_the_notebook.txt", "w").write("written")
try:
    open(OUTSIDE, "w").write("written")
except OSError:
    pass
'''
A1_ALLOC = '''
try:
    hog = torch.empty(10 * 2**30, dtype=torch.uint8).fill_(1)
except (RuntimeError, MemoryError):
    hog = None
''' + A1_RIGHT
A1_GLOBAL_STATE = A1_RIGHT + """
torch.set_num_threads(2)
torch.randn(512, 512) @ torch.randn(512, 512)
torch.set_default_dtype(torch.float64)
torch.set_grad_enabled(False)
torch.use_deterministic_algorithms(False)
"""
# Right code only when the process it runs in is as clean as a fresh one: its own session, its own
# folder (holding the notebook and whatever torch caches there) as HOME and TMPDIR, one
# thread, and nothing open but /dev/null (where its prints go), the files under the Python
# installation and its own two pipes to the grader: no socket and no file of another folder
# inherited from the process that forked it.
A1_PROBE = '''
import os
import sys
def _links():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out
_here = os.path.realpath(os.getcwd())
CLEAN = (os.getsid(0) == os.getpid()
         and os.path.realpath(os.environ["HOME"]) == _here
         and os.path.realpath(os.environ["TMPDIR"]) == _here
         and "a1_attention.ipynb" in os.listdir(".")
         and [f for f in os.listdir(".") if f.endswith(".ipynb")] == ["a1_attention.ipynb"]
         and len(os.listdir("/proc/self/task")) == 1
         and all(link == "/dev/null" or link.startswith((sys.prefix, sys.base_prefix, "pipe:"))
                 for link in _links())
         and sum(link.startswith("pipe:") for link in _links()) == 2
         and not any(m.startswith(("utils.attention", "utils.transformer", "utils.models"))
                     for m in sys.modules))
''' + A1_RIGHT.replace("    d_k = q.shape[-1]", "    d_k = q.shape[-1] if CLEAN else 1")

# Other processes' pipes (the grader's, the zygote's, other notebooks') are in /proc/PID/fd: reading
# one would steal another notebook's cases. Right code when every attempt is refused.
A1_OTHERS_PIPES = '''
import os
opened = 0
try:
    pids = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
except OSError:  # the kernel's confinement: even the list of processes is out of reach
    pids = []
for pid in pids:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        try:
            open(f"/proc/{pid}/fd/{fd}", "rb").close()
            opened += 1
        except OSError:
            pass
''' + A1_RIGHT.replace("    d_k = q.shape[-1]", "    d_k = q.shape[-1] if opened == 0 else 1")

# A process, a program, a socket: right code when all three are refused.
A1_ESCAPES = '''
import os
import socket
import subprocess
escaped = 0
for attempt in (lambda: subprocess.run(["true"]), lambda: os.fork() or os._exit(0),
                lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)):
    try:
        attempt()
        escaped += 1
    except Exception:
        pass
''' + A1_RIGHT.replace("    d_k = q.shape[-1]", "    d_k = q.shape[-1] if escaped == 0 else 1")

# A thread started with the start function of a fresh copy of the module: threads are allowed
# (forbidden code fails in every thread alike), and the grader kills it with its process.
A1_THREAD_RESTORED = A1_RIGHT + '''
import _imp
import importlib.machinery
import time
fresh = _imp.create_builtin(importlib.machinery.ModuleSpec("_thread", None, origin="built-in"))
fresh.start_new_thread(time.sleep, (30,))
'''

MHA_INIT = '''
class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads, bias=True, dropout=0.0):
        super().__init__()
        self.h, self.d_k = num_heads, d_model // num_heads
        self.w_q = nn.Linear(d_model, d_model, bias=bias)
        self.w_k = nn.Linear(d_model, d_model, bias=bias)
        self.w_v = nn.Linear(d_model, d_model, bias=bias)
        self.w_o = nn.Linear(d_model, d_model, bias=bias)
'''
MHA_CHUNKED = MHA_INIT + '''
    def forward(self, query, key, value, mask=None):
        q, k, v = self.w_q(query), self.w_k(key), self.w_v(value)
        if mask is not None and mask.dim() == 3:
            mask = mask.unsqueeze(1)
        heads = []
        for i in range(self.h):
            s = slice(i * self.d_k, (i + 1) * self.d_k)
            m = None
            if mask is not None:
                m = mask.expand(q.shape[0], self.h, query.shape[1], key.shape[1])[:, i]
            out, _ = scaled_dot_product_attention(q[..., s], k[..., s], v[..., s], m)
            heads.append(out)
        return self.w_o(torch.cat(heads, dim=-1))
'''


def _mha(prep: str, proj: str = "self.w_q(query), self.w_k(key), self.w_v(value)") -> str:
    return MHA_INIT + f'''
    def forward(self, query, key, value, mask=None):
        b, l_q, d = query.shape
        q, k, v = ({proj})
        q, k, v = (t.view(b, -1, self.h, self.d_k).transpose(1, 2) for t in (q, k, v))
{prep}
        out, _ = scaled_dot_product_attention(q, k, v, mask)
        return self.w_o(out.transpose(1, 2).reshape(b, l_q, d))
'''


UNSQUEEZE = "        if mask is not None and mask.dim() == 3:\n            mask = mask.unsqueeze(1)"
MHA_EINSUM = MHA_INIT + '''
    def forward(self, query, key, value, mask=None):
        b, l_q, d = query.shape
        q = self.w_q(query).view(b, l_q, self.h, self.d_k)
        k = self.w_k(key).view(b, key.shape[1], self.h, self.d_k)
        v = self.w_v(value).view(b, key.shape[1], self.h, self.d_k)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.d_k ** 0.5
        if mask is not None:
            if mask.dim() == 3:
                mask = mask.unsqueeze(1)
            s = s.masked_fill(~mask, float("-inf"))
        w = torch.softmax(s, dim=-1)
        return self.w_o(torch.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, l_q, d))
'''
MHA_WQ_KEYS = _mha(UNSQUEEZE, "self.w_q(query), self.w_q(key), self.w_v(value)")
MHA_KV_SWAP = _mha(UNSQUEEZE, "self.w_q(query), self.w_k(value), self.w_v(key)")
MHA_NO_HEAD_AXIS = _mha("        pass")
MHA_HANG = '''
class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads, bias=True, dropout=0.0):
        super().__init__()
        while True:
            pass
'''

PE_COLUMN = '''
def sinusoidal_encoding(max_len, d_model):
    t = torch.arange(max_len, dtype=torch.float32)[:, None]
    j = torch.arange(d_model, dtype=torch.float32)
    angle = t / 10000 ** (j / d_model)
    pe = torch.zeros(max_len, d_model)
    pe[:, 0::2] = torch.sin(angle[:, 0::2])
    pe[:, 1::2] = torch.cos(angle[:, 1::2])
    return pe
'''
LN_INIT = '''
    def __init__(self, d_model, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))
'''


def _ln(body: str, init: str = LN_INIT) -> str:
    return f'''
class LayerNorm(nn.Module):
{init}
    def forward(self, x):
{body}
'''


LN_SWAPPED = _ln('''        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return (x - mean) / torch.sqrt(var + self.eps) * self.bias + self.weight''')
LN_DETACHED = _ln('''        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return ((x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias).detach()''')
LN_IN_PLACE = _ln('''        x = x.detach()
        x.sub_(x.mean(-1, keepdim=True))
        var = (x ** 2).mean(-1, keepdim=True)
        return x / torch.sqrt(var + self.eps) * self.weight + self.bias''')
LN_TORCH = '''
class LayerNorm(nn.LayerNorm):
    pass
'''
LN_HANG_INIT = _ln("        return x", init='''
    def __init__(self, d_model, eps=1e-5):
        super().__init__()
        while True:
            pass
''')


def _enc(body: str) -> str:
    return f'''
class EncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward, dropout=0.0, activation="relu",
                 norm_first=False):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, nhead)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = LayerNorm(d_model)
        self.norm2 = LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = {{"relu": F.relu, "gelu": F.gelu}}[activation]
        self.norm_first = norm_first

    def forward(self, x, mask=None):
        def sa(y):
            return self.dropout(self.self_attn(y, y, y, mask))

        def ff(y):
            return self.dropout(self.linear2(self.dropout(self.activation(self.linear1(y)))))

        def ff_no_drop(y):
            return self.linear2(self.dropout(self.activation(self.linear1(y))))
{body}
'''


ENC_TUTORIAL = _enc('''        x = self.norm1(x + sa(self.norm1(x)))
        return self.norm2(x + ff(self.norm2(x)))''')
ENC_PRE_FROM_NORM = _enc('''        if self.norm_first:
            h = self.norm1(x)
            x = h + sa(h)
            h = self.norm2(x)
            return h + ff(h)
        x = self.norm1(x + sa(x))
        return self.norm2(x + ff(x))''')
ENC_NO_FF_RESIDUAL = _enc('''        if self.norm_first:
            x = x + sa(self.norm1(x))
            return ff(self.norm2(x))
        x = self.norm1(x + sa(x))
        return self.norm2(ff(x))''')
ENC_FF_NO_DROPOUT = _enc('''        if self.norm_first:
            x = x + sa(self.norm1(x))
            return x + ff_no_drop(self.norm2(x))
        x = self.norm1(x + sa(x))
        return self.norm2(x + ff_no_drop(x))''')
ENC_REFERENCE = "from utils.transformer import EncoderLayer\n"
ENC_LAYERS_MODULE = "from utils.transformer_layers import EncoderLayer\n"


def torch_layer(kind: str) -> str:
    """A student's ``{kind}Layer`` that is torch's own layer, batch first ("Encoder" or
    "Decoder")."""
    return f'''
class {kind}Layer(nn.Transformer{kind}Layer):
    def __init__(self, d_model, nhead, dim_feedforward, dropout=0.0, activation="relu",
                 norm_first=False):
        super().__init__(d_model, nhead, dim_feedforward, dropout, activation,
                         batch_first=True, norm_first=norm_first)
'''


ENC_TORCH = torch_layer("Encoder")

# student: (assignment, {solution cell index: source}, expectation)
SUBMISSIONS: dict[str, tuple[str, dict[int, str], str]] = {
    "ok_a1_book": ("a1_attention", {}, "full"),
    "ok_a1_einsum": ("a1_attention", {3: A1_EINSUM}, "full"),
    "ok_a1_float64": ("a1_attention", {3: A1_FLOAT64}, "full"),
    "ok_a2_chunked": ("a2_multi_head_attention", {3: MHA_CHUNKED}, "full"),
    "ok_a2_einsum": ("a2_multi_head_attention", {3: MHA_EINSUM}, "full"),
    "ok_a4_book": ("a4_positional_encoding_layer_norm", {}, "full"),
    "ok_a6_book": ("a6_encoder_layer", {}, "full"),
    "bad_a1_batch_axis": ("a1_attention", {3: A1_BATCH_AXIS}, "softmax over the batch axis"),
    "bad_a1_times_sqrt": ("a1_attention", {3: A1_TIMES}, "multiplied by sqrt(d_k)"),
    "bad_a1_scale_after": ("a1_attention", {3: A1_AFTER}, "scaling comes after the softmax"),
    "bad_a1_kv_swapped": ("a1_attention", {3: A1_SWAP}, "key and value swapped"),
    "ok_a1_nan_to_num": ("a1_attention", {3: A1_NAN_GRAD}, "full"),
    "bad_a2_wq_keys": ("a2_multi_head_attention", {3: MHA_WQ_KEYS}, "W_q is reused for the keys"),
    "bad_a2_kv_swapped": ("a2_multi_head_attention", {3: MHA_KV_SWAP}, "key and value swapped"),
    "bad_a2_mask_heads": ("a2_multi_head_attention", {3: MHA_NO_HEAD_AXIS},
                          "lines up its batch axis with the heads"),
    "bad_a4_column": ("a4_positional_encoding_layer_norm", {3: PE_COLUMN},
                      "the column index is in the exponent"),
    "bad_a4_swapped": ("a4_positional_encoding_layer_norm", {6: LN_SWAPPED},
                       "weight and bias swapped"),
    "bad_a4_detached": ("a4_positional_encoding_layer_norm", {6: LN_DETACHED},
                        "detached from the autograd graph"),
    "bad_a4_in_place": ("a4_positional_encoding_layer_norm", {6: LN_IN_PLACE},
                        "changes its input `x` in place"),
    "bad_a6_tutorial": ("a6_encoder_layer", {3: ENC_TUTORIAL}, "LayerNorm(x + MHA(LayerNorm(x)))"),
    "bad_a6_pre_from_norm": ("a6_encoder_layer", {3: ENC_PRE_FROM_NORM},
                             "the residual is taken from norm(x)"),
    "bad_a6_no_ff_residual": ("a6_encoder_layer", {3: ENC_NO_FF_RESIDUAL},
                              "feed-forward block's residual is missing"),
    "bad_a6_ff_dropout": ("a6_encoder_layer", {3: ENC_FF_NO_DROPOUT},
                          "no dropout on the feed-forward output"),
    "evil_a1_replaces_checkers": ("a1_attention", {3: A1_CHEAT}, "zero"),
    "evil_a1_prints_scores": ("a1_attention", {3: A1_FAKE_PRINT}, "zero"),
    "evil_a1_reference": ("a1_attention", {3: A1_REFERENCE}, "imports utils.attention"),
    "evil_a1_fast_path": ("a1_attention", {3: A1_FAST_PATH}, "imports utils.fast_attention"),
    "evil_a1_hidden_import": ("a1_attention", {3: A1_HIDDEN_IMPORT},
                              "tried to read the book's sources or reference code"),
    "evil_a1_torch_sdpa": ("a1_attention", {3: A1_TORCH}, "F.scaled_dot_product_attention"),
    "evil_a1_os_exit": ("a1_attention", {3: A1_EXIT}, "ended its own process"),
    "evil_a1_sys_exit": ("a1_attention", {3: A1_SYS_EXIT}, "full"),
    "evil_a1_writes_files": ("a1_attention", {3: A1_WRITES}, "full"),
    "evil_a1_10gb": ("a1_attention", {3: A1_ALLOC}, "full"),
    "evil_a1_global_state": ("a1_attention", {3: A1_GLOBAL_STATE}, "full"),
    "evil_a1_probes_its_process": ("a1_attention", {3: A1_PROBE}, "full"),
    "evil_a1_others_pipes": ("a1_attention", {3: A1_OTHERS_PIPES}, "full"),
    "evil_a1_escapes": ("a1_attention", {3: A1_ESCAPES}, "full"),
    "evil_a1_thread_restored": ("a1_attention", {3: A1_THREAD_RESTORED}, "full"),
    "evil_a2_endless_init": ("a2_multi_head_attention", {3: MHA_HANG}, "did not finish within"),
    "evil_a4_torch_layer_norm": ("a4_positional_encoding_layer_norm", {6: LN_TORCH},
                                 "nn.LayerNorm"),
    "evil_a6_reference": ("a6_encoder_layer", {3: ENC_REFERENCE}, "imports utils.transformer"),
    "evil_a6_layers_module": ("a6_encoder_layer", {3: ENC_LAYERS_MODULE},
                              "imports utils.transformer_layers"),
    "evil_a6_torch_layer": ("a6_encoder_layer", {3: ENC_TORCH}, "nn.TransformerEncoderLayer"),
}


def write_submissions(folder: Path, outside: Path, nested: bool = True,
                      students: Iterable[str] | None = None) -> dict[str, Path]:
    """Write every submission (or those of ``students``) as
    ``folder/<student>/<assignment>/<assignment>.ipynb`` (nbgrader's layout) or, with
    ``nested=False``, ``folder/<student>/<assignment>.ipynb``."""
    paths = {}
    for student in SUBMISSIONS if students is None else students:
        assignment, cells, _ = SUBMISSIONS[student]
        nb = nbformat.read(ROOT / "book" / "assignments" / f"{assignment}.ipynb", as_version=4)
        for index, source in cells.items():
            assert "### BEGIN SOLUTION" in nb.cells[index].source, (student, index)
            nb.cells[index].source = source.replace("OUTSIDE", repr(str(outside)))
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        where = folder / student / (assignment if nested else "")
        where.mkdir(parents=True, exist_ok=True)
        paths[student] = where / f"{assignment}.ipynb"
        nbformat.write(nb, paths[student])
    return paths
