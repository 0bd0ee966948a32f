"""The hostile suite's submissions: attacks on the grader, and honest notebooks it must not fail.

Each entry of `ATTACKS` is ``student: Attack``. An attack is written into its assignment's source
notebook in place of one solution cell (or several), so that it looks like a handed-in notebook,
and says what the grader must give it: the score ("full", "zero" or a number), a flag that must
be in its row, and a phrase that must be in its feedback. In the sources, VICTIM, CHECKER,
GRADES, OUTDIR and OUTSIDE stand for the paths of another student's notebook, the grader's own
checker code, the grades.csv being written, the output folder and a file outside everything.

The four kinds, as the issue names them: escapes (E), one submission stopping the class (S),
full marks for work not done (F), zero for honest work (Z).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

from grading_submissions import A1_RIGHT


def _a1_with(prelude: str, body: str = "") -> str:
    """A right attention function that first runs ``body`` (when given) on every call."""
    fn = A1_RIGHT if not body else A1_RIGHT.replace(
        "    scores = q @ k", body.rstrip() + "\n    scores = q @ k", 1)
    return prelude + "\n" + fn


def _send_to_every_pipe(body: bytes) -> str:
    """Code (indented for a function body) that writes one frame holding the JSON ``body`` to
    every file descriptor it can, the grader's pipe among them."""
    return f'''
    import os, struct
    body = {body!r}
    payload = struct.pack(">I", len(body)) + body
    for fd in range(3, 40):
        try:
            os.write(fd, struct.pack(">I", len(payload)) + payload)
        except OSError:
            pass
'''


# torch's attention, in code that no text search can see
_HIDDEN = base64.b64encode(b"""
def scaled_dot_product_attention(q, k, v, mask=None):
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask), w
""")


# The outputs' attacks (`tests/test_hostile_grading.py` checks the files they aim at).
FORMULA_NAME = '=HYPERLINK("evil.example","open me")'
HEADING_NAME = "ann\n# Forged heading"
LATIN1_NAME = "caf\udce9"  # the folder's name is the bytes b"caf\xe9", not UTF-8
SURROGATE_SHOWN = "byte \\\\xff here, and \\\\u202e reversed"  # as the raw Markdown holds it
DEEP_LEVELS = 900  # folders, under the scratch folder's 1,000 files
LIVE_ANSWER = """**Answer.**

<!-- ### BEGIN SOLUTION -->
# Forged heading
![pixel](http://evil.example/pixel.png) and [click](http://evil.example/)
<img src="http://evil.example/i.png"> www.evil.example https://evil.example/x
Title
=====
\u202e reversed &#x202e; too
<!-- ### END SOLUTION -->"""


@dataclass
class Attack:
    """One submission: its assignment, the cells it replaces, and what the grader must give."""

    kind: str  # E, S, F or Z
    assignment: str
    cells: dict[int, str]
    score: str | float | None  # "full", "zero", the exact points, or None (see columns)
    flag: str | None = None  # must be among the row's flags ("" = no flag at all)
    phrase: str = ""  # must be in the feedback
    columns: dict[str, float] = field(default_factory=dict)  # exact points of some cases
    file_name: str = ""  # the notebook's file name ("" = <assignment>.ipynb)
    nbformat3: bool = False
    replace: dict[int, tuple[str, str]] = field(default_factory=dict)  # in the book's cell


# Leases, change notices and inode flags on files the child may read (its own /proc entry
# too): each refused by the filter; ACTED lists what was not.
LEASES = '''
import fcntl, os, struct

ACTED = []
for name, path in (("a file it may read", os.__file__), ("its own /proc entry", "/proc/self/stat")):
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, 1024, fcntl.F_RDLCK)  # F_SETLEASE: other processes' opens would block
        ACTED.append("lease on " + name)
    except OSError:
        pass
    try:  # FS_IOC_SETFLAGS with the flags it has: the owner check is what is refused
        flags = bytearray(4)
        fcntl.ioctl(fd, 0x80086601, flags)  # FS_IOC_GETFLAGS
        fcntl.ioctl(fd, 0x40086602, bytes(flags))
        ACTED.append("inode flags of " + name)
    except OSError:
        pass
    os.close(fd)
folder = os.open(os.path.dirname(os.__file__), os.O_RDONLY | os.O_DIRECTORY)
try:
    fcntl.fcntl(folder, 1026, 0x80000002)  # F_NOTIFY (DN_MODIFY | DN_MULTISHOT)
    ACTED.append("change notices")
except OSError:
    pass
os.close(folder)
'''


ATTACKS: dict[str, Attack] = {
    # ---- E: escapes ----------------------------------------------------------------------
    "e_file_lease": Attack("E", "a1_attention",
                           {3: _a1_with(LEASES, "    if ACTED:\n        return q, k\n")}, "full",
                           ""),
    "e_fork": Attack("E", "a1_attention", {3: _a1_with('''
import os, time
try:
    if os.fork() == 0:  # a child that would outlive the grader and rewrite a grade
        time.sleep(3)
        open(GRADES, "a").write("victim,a1_attention,10\\n")
        os._exit(0)
except OSError:
    pass
''')}, "full", "blocked"),
    "e_ctypes_fork": Attack("E", "a1_attention", {3: _a1_with('''
import ctypes
try:
    libc = ctypes.CDLL(None)
    pid = libc.syscall(57)  # fork(2) by number, below Python's audit events
    if pid == 0:
        libc.syscall(60, 0)
except Exception:
    pass
''')}, "full", "blocked"),
    "e_posix_spawn": Attack("E", "a1_attention", {3: _a1_with('''
import os, subprocess
for attempt in (lambda: os.posix_spawn("/bin/sh", ["sh", "-c", "echo x > " + OUTSIDE], {}),
                lambda: subprocess.Popen(["/bin/sh", "-c", "sleep 30"]),
                lambda: os.system("touch " + OUTSIDE)):
    try:
        attempt()
    except Exception:
        pass
''')}, "full", "blocked"),
    "e_kill_grader": Attack("E", "a1_attention", {3: _a1_with('''
import os, signal
for target in (os.getppid(), -1, 0, 1):
    try:
        os.kill(target, signal.SIGKILL)
    except OSError:
        pass
''')}, "full"),
    # A signal sent by the kernel on the child's behalf: a pipe's owner (F_SETOWN, or the ioctl)
    # gets the signal chosen with F_SETSIG when the pipe becomes readable. Landlock's signal
    # scope stops the delivery only from its ABI 6 on; the filter refuses to name an owner or
    # a signal at all, and a right function then answers rightly.
    "e_sigio_kill_grader": Attack("E", "a1_attention", {3: _a1_with('''
import fcntl, os, signal
ACTED = []
r, w = os.pipe()
for name, call in (("F_SETOWN", lambda: fcntl.fcntl(r, fcntl.F_SETOWN, os.getppid())),
                   ("F_SETSIG", lambda: fcntl.fcntl(r, 10, signal.SIGKILL)),
                   ("FIOSETOWN",
                    lambda: fcntl.ioctl(r, 0x8901, os.getppid().to_bytes(4, "little")))):
    try:
        call()
        ACTED.append(name)
    except OSError:
        pass
fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_ASYNC)
os.write(w, b"x")
''', "    if ACTED:\n        return q, k\n")}, "full"),
    "e_writes_victim": Attack("E", "a1_attention", {3: _a1_with('''
import torch
for path in (VICTIM, CHECKER, GRADES, OUTSIDE, OUTDIR + "/grades.csv"):
    for attempt in (lambda: open(path, "w").write("0"), lambda: torch.save({"x": 1}, path)):
        try:
            attempt()
        except Exception:
            pass
''')}, "full", "blocked"),
    "e_symlink_out": Attack("E", "a1_attention", {3: _a1_with('''
import os
try:
    os.symlink(VICTIM, "victim.ipynb")
    open("victim.ipynb", "w").write("{}")
except OSError:
    pass
try:
    os.link(VICTIM, "hard.ipynb")
except OSError:
    pass
''')}, "full"),
    "e_subinterpreter": Attack("E", "a1_attention", {3: _a1_with('''
try:
    import _xxsubinterpreters as sub
    sub.run_string(sub.create(), "open(" + repr(OUTSIDE) + ", 'w').write('x')")
except Exception:
    pass
''')}, "full", "blocked"),
    "e_proc": Attack("E", "a1_attention", {3: _a1_with('''
import os
found = []
for probe in (lambda: os.readlink(f"/proc/{os.getppid()}/cwd"), lambda: os.listdir("/proc"),
              lambda: open(f"/proc/{os.getppid()}/cmdline").read(),
              lambda: os.listdir(f"/proc/{os.getppid()}/fd")):
    try:
        found.append(probe())
    except OSError:
        pass
assert not found, found  # nothing of another process is visible: the function gets defined
''')}, "full", "blocked"),
    "e_limits": Attack("E", "a1_attention", {3: _a1_with('''
import resource
try:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
except (ValueError, OSError):
    pass
try:
    big = torch.empty(20 * 2**30, dtype=torch.uint8)  # 20 GB: past the memory limit
except (RuntimeError, MemoryError):
    pass
''')}, "full"),
    "e_ctypes_memory": Attack("E", "a1_attention", {3: _a1_with('''
import ctypes
try:
    ctypes.string_at(id(torch), 64)  # raw memory of the process
except Exception:
    pass
import gc
try:
    gc.get_objects()
except Exception:
    pass
''')}, "full", "blocked"),
    # ---- S: one submission stops the class ---------------------------------------------------
    "s_garbage_frames": Attack("S", "a1_attention", {3: _a1_with('''
import os
for fd in range(3, 40):
    try:
        os.write(fd, b"\\xff" * 64)
    except OSError:
        pass
''')}, "zero", "protocol"),
    "s_deep_message": Attack("S", "a1_attention", {3: _a1_with('''
import os, struct
body = ('{"body":{"op":"result","id":0,"raw":' + "[" * 5000 + "]" * 5000
        + '},"tensors":[]}').encode()
payload = struct.pack(">I", len(body)) + body
frame = struct.pack(">I", len(payload)) + payload
for fd in range(3, 40):
    try:
        os.write(fd, frame)
    except OSError:
        pass
''')}, "zero", "protocol"),
    "s_huge_frame": Attack("S", "a1_attention", {3: _a1_with('''
import os, struct
for fd in range(3, 40):
    try:
        os.write(fd, struct.pack(">I", 2**31) + b"x" * 1000)
    except OSError:
        pass
''')}, "zero", "protocol"),
    "s_bad_result": Attack("S", "a1_attention", {3: _a1_with("", _send_to_every_pipe(
        b'{"body":{"op":"result","id":"zero","raw":{"status":1}},"tensors":[]}'))},
        "zero", "protocol"),
    "s_flag_flood": Attack("S", "a1_attention", {3: _a1_with('''
import os, stat, struct
pipes = []
for fd in range(3, 40):
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            pipes.append(fd)
    except OSError:
        pass
for i in range(20000):
    body = ('{"body":{"op":"flag","kind":"blocked","detail":"' + "x" * 250 + str(i)
            + '"},"tensors":[]}').encode()
    payload = struct.pack(">I", len(body)) + body
    for fd in pipes:
        try:
            os.write(fd, struct.pack(">I", len(payload)) + payload)
        except OSError:
            pass
''')}, "full", "blocked", "reports; the rest were not read"),
    "s_print_flood": Attack("S", "a1_attention", {3: _a1_with('''
line = "x" * 1000
for _ in range(100_000):  # 100 MB of prints, past the file-size limit
    try:
        print(line)
    except OSError:
        break
''')}, "full"),
    "s_disk_flood": Attack("S", "a1_attention", {3: _a1_with("", '''
    for i in range(200):
        try:
            with open(f"junk{i}.bin", "wb") as f:
                f.write(b"x" * 2**20 * 4)
        except OSError:
            break
''')}, "full", "limits", "filled its folder"),
    "s_sleeps": Attack("S", "a1_attention", {3: _a1_with("", '''
    import time
    time.sleep(3600)
''')}, "zero", "timeout", "waiting or sleeping"),
    "s_spins": Attack("S", "a1_attention", {3: _a1_with("", '''
    while True:
        pass
''')}, "zero", "timeout", "CPU time"),
    "s_exit_in_case": Attack("S", "a1_attention", {3: _a1_with("", '''
    import os
    os._exit(3)
''')}, "zero", "crashed"),
    "s_fills_its_pipe": Attack("S", "a1_attention", {3: _a1_with("", '''
    import sys, os, time
    f = sys._getframe()
    while f is not None and f.f_code.co_name != "serve":
        f = f.f_back
    if f is not None and tuple(q.shape) == (2, 5, 8):
        # Fill the pipe the grader writes to, answer, and never read again.
        inp, out, msg = f.f_locals["inp"], f.f_locals["out"], f.f_locals["msg"]
        w = os.open(f"/proc/self/fd/{inp}", os.O_WRONLY | os.O_NONBLOCK)
        try:
            while True:
                os.write(w, b"\\0" * 4096)
        except BlockingIOError:
            pass
        from grader.protocol import write_frame
        write_frame(out, {"op": "result", "id": msg["id"],
                          "raw": {"status": "call", "message": "x", "tensors": {}, "notes": []}})
        time.sleep(10**6)
''')}, None, "protocol", "stopped reading"),
    "s_deep_code": Attack("S", "a1_attention", {3: "x = 1" + " + 1" * 200000 + "\n" + A1_RIGHT},
                          "zero"),
    "s_thread_bomb": Attack("S", "a1_attention", {3: _a1_with('''
import threading, time
threading.stack_size(65536)
stop = threading.Event()
end = time.monotonic() + 5
while time.monotonic() < end:
    try:
        threading.Thread(target=stop.wait, daemon=True).start()
    except RuntimeError:
        time.sleep(0.001)
''')}, "full", "limits", "threads"),  # the kernel refuses threads past 64: no harm done
    "s_oracle_memory": Attack("S", "a3_masks", {16: '''
def test_batch_mask(batch_mask_fn):
    batch_mask_fn(torch.zeros(1024, dtype=torch.long), 512)  # a 1024 x 512 x 512 mask
'''}, None, columns={f"batch_mask_test.{b}": 0 for b in (
        "sees_next", "inverted", "left", "queries", "or", "no_padding", "no_causal", "one_more",
        "max_len", "no_head_axis", "float")}),
    # Text and names that the outputs must show escaped, never act on (one string used to end the
    # class's grading without grades.csv). An exception message of a cell holding a lone
    # surrogate and a bidirectional override: shown escaped in the feedback.
    "s_surrogate_error": Attack("S", "a1_attention", {3: A1_RIGHT + '''

raise ValueError("byte \\udcff here, and \\u202e reversed")
'''}, "full", phrase=SURROGATE_SHOWN),
    # A scratch folder left 900 folders deep with names too long for any path to reach the
    # bottom: no grader error, nothing left (the grader's removal of a deeper tree, for runs
    # without the kernel's tmpfs, is tested in tests/test_grading_output.py).
    "s_deep_scratch": Attack("S", "a1_attention", {3: f'''
import os
here = os.getcwd()
for i in range({DEEP_LEVELS}):
    name = f"{{i:05d}}" * 51
    os.mkdir(name)
    os.chdir(name)
os.chdir(here)
''' + A1_RIGHT}, "full", ""),
    # Student folders named like a formula, with a newline and a heading, and in Latin-1 bytes
    # (an LMS export): each graded in full, its name shown escaped.
    FORMULA_NAME: Attack("S", "a1_attention", {}, "full", ""),
    HEADING_NAME: Attack("S", "a1_attention", {}, "full", ""),
    LATIN1_NAME: Attack("S", "a1_attention", {}, "full", ""),
    # A written answer with a heading, an image, a link, raw HTML and a bidi override.
    "e_markdown_answer": Attack("E", "a1_attention", {8: LIVE_ANSWER}, "full", ""),
    # ---- F: full marks for work not done ---------------------------------------------------
    "f_partial": Attack("F", "a1_attention", {3: '''
import functools
_sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, dropout_p=0.0)

def scaled_dot_product_attention(q, k, v, mask=None):
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1)
    return _sdpa(q, k, v, attn_mask=mask), w
'''}, "zero", "reference used", "F.scaled_dot_product_attention"),
    "f_getattr": Attack("F", "a1_attention", {3: '''
def scaled_dot_product_attention(q, k, v, mask=None):
    fn = getattr(torch.nn.functional, "scaled_dot_" + "product_attention")
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1)
    return fn(q, k, v, attn_mask=mask), w
'''}, "zero", "reference used"),
    "f_exec": Attack("F", "a1_attention", {3: f'''
import base64
exec(base64.b64decode({_HIDDEN!r}).decode())
'''}, "zero", "reference used"),
    "f_aten": Attack("F", "a1_attention", {3: '''
def scaled_dot_product_attention(q, k, v, mask=None):
    op = torch._C._jit_get_operation("aten::_scaled_dot_product_flash_attention_for_cpu")[0]
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1)
    return op(q, k, v)[0], w
'''}, "zero", "reference used"),
    "f_decomposition": Attack("F", "a1_attention", {3: '''
from torch._decomp import decomposition_table

def scaled_dot_product_attention(q, k, v, mask=None):
    for op, fn in decomposition_table.items():
        if "scaled_dot_product" in str(op):
            w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1)
            return fn(q, k, v)[0], w
    raise RuntimeError("no decomposition")
'''}, "zero", "reference used"),
    "f_unpoison": Attack("F", "a1_attention", {3: '''
import weakref
for fin in list(getattr(weakref.finalize, "_registry", {})):
    try:
        fin()  # run every finalizer: torch's libraries would take their kernels back
    except Exception:
        pass

def scaled_dot_product_attention(q, k, v, mask=None):
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask), w
'''}, "zero", "reference used"),
    "f_reads_reference": Attack("F", "a1_attention", {3: '''
import json
src = ""
for path in (UTILS + "/attention.py", CHECKER, BOOK + "/01_attention.ipynb"):
    try:
        src += open(path).read()
    except OSError:
        pass
exec(src)
'''}, "zero", "reference used", "reference code"),
    "f_patches_runner": Attack("F", "a1_attention", {3: '''
import sys
core = sys.modules["utils.checks.core"]
def fake(obj, spec, timeout=None):  # claims outputs equal to... whatever it can compute
    q = spec.tensors["q"]
    return {"status": "ok", "message": "", "notes": [],
            "tensors": {"out:output": torch.zeros_like(q), "out:weights": torch.zeros(1)}}
core.guarded_exercise = fake
sys.modules["grader.child"].guarded_exercise = fake
def scaled_dot_product_attention(q, k, v, mask=None):
    return q, k
'''}, "zero"),
    "f_mask_test_inspects": Attack("F", "a3_masks", {13: '''
import inspect, sys

def test_causal_mask(causal_mask_fn):
    # Tell the implementations apart by looking instead of testing.
    cells = [c.cell_contents for c in (causal_mask_fn.__closure__ or ())]
    caller = sys._getframe(1).f_locals
    hint = repr(cells) + repr(sorted(caller)) + inspect.getsource(causal_mask_fn)
    assert "sees_next" not in hint and "codes" not in caller
'''}, None, columns={f"causal_mask_test.{b}": 0 for b in (
        "sees_next", "no_diagonal", "inverted", "upper", "late_leak", "all_true", "float",
        "additive", "lead_axis")}),
    "f_mask_test_remembers": Attack("F", "a3_masks", {13: '''
import os

def test_causal_mask(causal_mask_fn):
    # Remember what an earlier call saw: the first implementation seen is taken for right.
    seen = "seen.txt"
    first = causal_mask_fn(6).tolist()
    if os.path.exists(seen):
        assert open(seen).read() == repr(first)
    else:
        open(seen, "w").write(repr(first))
'''}, None, columns={f"causal_mask_test.{b}": 0 for b in (
        "sees_next", "no_diagonal", "inverted", "upper", "late_leak", "all_true", "float",
        "additive", "lead_axis")}),
    "f_hand_written_model": Attack("F", "a8_train", {3: '''
class Seq2Seq(nn.Module):
    """Computes the reversal by hand: no learning at all."""

    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        b, length = tgt.shape
        logits = torch.zeros(b, length, self.vocab_size) + 0 * self.w
        for i in range(b):
            real = src[i][src[i] != PAD]
            answer = real.flip(0).tolist() + [EOS]
            for t in range(length):
                logits[i, t, answer[t] if t < len(answer) else PAD] = 10.0
        return logits


def build_model(vocab_size):
    return Seq2Seq(vocab_size)
''', 9: '''
def train(model, steps, seed):
    with torch.no_grad():
        model.w += 1.0  # "training" changed a parameter
    return []
'''}, None, columns={"training.training": 0}, phrase="answers without training"),
    "f_stub_runner": Attack("F", "a8_train", {9: '''
import sys
runners = sys.modules["utils.checks.training_runner"]

def _reverse(obj, spec, x):
    src = x["src"]
    out = torch.full((src.shape[0], src.shape[1] + 1), PAD, dtype=torch.long)
    for i in range(src.shape[0]):
        real = src[i][src[i] != PAD]
        row = real.flip(0).tolist() + [EOS]
        out[i, : len(row)] = torch.tensor(row)
    return out

def _states(obj, spec, x):
    return {"initial.w": torch.zeros(3), "trained.w": torch.ones(3)}

runners._MODES["evaluate"] = _reverse
runners._MODES["train_only"] = _states
runners._MODES["training"] = lambda obj, spec, x: (_reverse(obj, spec, x),
                                                   torch.tensor([1.0, 3.0], dtype=torch.float64))

def train(model, steps, seed):
    return []
'''}, None, columns={"training.training": 0}, phrase="answers without training"),
    "f_group_norm": Attack("F", "a4_positional_encoding_layer_norm", {}, None,
                           "reference used",
                           columns={"layer_norm.batch": 0, "positional_encoding.small": 1},
                           replace={6: ("""        mean = x.mean(dim=-1, keepdim=True)
        var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias""",
                                        """        shape = x.shape
        y = torch.nn.functional.group_norm(x.reshape(-1, 1, shape[-1]), 1, eps=self.eps)
        return y.reshape(shape) * self.weight + self.bias""")}),
    "f_local_mask": Attack("F", "a7_decoder_layer", {}, None, "reference used",
                           replace={3: ("return torch.ones(length, length, dtype=torch.bool)"
                                        ".tril()",
                                        "from utils.masks import local_mask\n"
                                        "        return local_mask(length, max(length, 1), "
                                        "causal=True)")}),
    "f_quantizable_mha": Attack("F", "a2_multi_head_attention", {3: """
import torch.ao.nn.quantizable as _q
import torch.ao.nn.quantized as _qd


class MultiHeadAttention(nn.Module):
    # Hands the work to torch's quantizable MultiheadAttention (its own forward).

    def __init__(self, d_model, num_heads, bias=True, dropout=0.0):
        super().__init__()
        self.w_q = nn.Linear(d_model, d_model, bias=bias)
        self.w_k = nn.Linear(d_model, d_model, bias=bias)
        self.w_v = nn.Linear(d_model, d_model, bias=bias)
        self.w_o = nn.Linear(d_model, d_model, bias=bias)
        impl = _q.MultiheadAttention.__new__(_q.MultiheadAttention)
        nn.Module.__init__(impl)  # skip nn.MultiheadAttention.__init__ (poisoned)
        impl.embed_dim, impl.num_heads = d_model, num_heads
        impl.dropout, impl.batch_first = dropout, False
        impl.kdim = impl.vdim = d_model
        impl.bias_k = impl.bias_v = None
        impl.add_zero_attn = False
        impl.q_scaling_product = _qd.FloatFunctional()
        for name in ("quant_attn_output", "quant_attn_output_weights", "dequant_q", "dequant_k",
                     "dequant_v"):
            setattr(impl, name, nn.Identity())
        object.__setattr__(self, "_impl", impl)  # not a submodule: no extra parameters

    def forward(self, query, key, value, mask=None):
        impl = self._impl
        impl.linear_Q, impl.linear_K = self.w_q, self.w_k
        impl.linear_V, impl.out_proj = self.w_v, self.w_o
        impl.train(self.training)
        b, l_q, _ = query.shape
        l_k = key.shape[1]
        attn_mask = None
        if mask is not None:
            m = mask
            if m.dim() == 3:
                m = m[:, None]
            m = m.expand(b, impl.num_heads, l_q, l_k).reshape(b * impl.num_heads, l_q, l_k)
            attn_mask = ~m
        out, _ = impl(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                      attn_mask=attn_mask, need_weights=False)
        return out.transpose(0, 1)
"""}, "zero",
                                "reference used"),
    # A result of its own, written straight to the grader's pipe before the real one.
    "f_forged_result": Attack("F", "a1_attention", {3: _a1_with("", _send_to_every_pipe(
        b'{"body":{"op":"result","id":0,"raw":{"status":"ok","message":"","notes":[],'
        b'"tensors":{}}},"tensors":[]}'))}, "zero"),
    # ---- Z: zero for honest work ------------------------------------------------------------
    "z_browser_copy": Attack("Z", "a1_attention", {3: A1_RIGHT}, "full",
                             file_name="a1_attention (1).ipynb"),
    "z_jupyter_copy": Attack("Z", "a1_attention", {3: A1_RIGHT}, "full",
                             file_name="A1_Attention-Copy1.ipynb"),
    "z_renamed": Attack("Z", "a1_attention", {3: A1_RIGHT}, "full", file_name="homework.ipynb"),
    "z_checker_in_comment": Attack("Z", "a1_attention", {3: '''
# I ran check_scaled_dot_product_attention(scaled_dot_product_attention) below to test this.
''' + A1_RIGHT}, "full"),
    "z_magics": Attack("Z", "a1_attention", {3: '''
!pip install nothing-at-all
%matplotlib inline
NOTE = """
!this line is text inside a string, not a shell command
%neither is this one
"""
''' + A1_RIGHT + '''
%time scaled_dot_product_attention(torch.ones(1, 2, 4), torch.ones(1, 2, 4), torch.ones(1, 2, 4))
ones = torch.ones(1, 2, 4)
out = %time scaled_dot_product_attention(ones, ones, ones)
assert out[0].shape == (1, 2, 4)
'''}, "full"),
    "z_nbformat3": Attack("Z", "a1_attention", {3: A1_RIGHT}, "full", nbformat3=True),
    "z_threads": Attack("Z", "a1_attention", {3: '''
import threading
results = []
worker = threading.Thread(target=lambda: results.append(sum(range(1000))))
worker.start()
worker.join()
''' + A1_RIGHT}, "full"),
    "z_writes_scratch": Attack("Z", "a1_attention", {3: '''
import tempfile
torch.save({"x": torch.ones(3)}, "weights.pt")
with tempfile.NamedTemporaryFile(suffix=".txt") as f:
    f.write(b"scratch")
''' + A1_RIGHT}, "full"),
}
