"""Checkpoints as they are published: sharded files, older buffers, configs checked against
the tensors, and inputs longer than the positions a RoPE model was trained on.

Every checkpoint is written here by `transformers` (``save_pretrained``, random weights) and
read back by `utils.pretrained`; the logits must equal the reference's to 1e-4. Nothing is
downloaded.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_pretrained import VOCAB, _assert_same_logits, _gpt2, _llama, _save

from utils.decoding import generate
from utils.pretrained import load_gpt2, load_llama

NEVER = 10_000


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tokens(b: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """{family: (folder of a sharded checkpoint, the transformers model)}: several shards each."""
    torch.manual_seed(3)
    made = {}
    for family, model in (
        ("gpt2", _gpt2(n_embd=32, n_head=2)),
        ("llama", _llama(num_attention_heads=4, num_key_value_heads=2)),
    ):
        folder = tmp_path_factory.mktemp(f"sharded-{family}")
        model.save_pretrained(folder, max_shard_size="20KB")
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        made[family] = (folder, model.eval())
    return made


def _load(family, folder, **kw):
    return (load_gpt2 if family == "gpt2" else load_llama)(folder, **kw)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sharded_checkpoint_loads_with_the_reference_logits(sharded, family):
    folder, hf = sharded[family]
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) >= 3 and not (folder / "model.safetensors").exists(), shards
    ours = _load(family, folder)
    _assert_same_logits(hf, ours, _tokens(2, 9))
    with torch.no_grad():
        expected = hf.generate(
            _tokens(1, 5),
            max_new_tokens=12,
            do_sample=False,
            attention_mask=torch.ones(1, 5, dtype=torch.long),
        )[0, 5:].tolist()
    assert generate(ours, _tokens(1, 5), 12, eos=NEVER)[0] == expected
    meta = _load(family, folder, device="meta")  # headers only: every shard opened, none read
    assert sum(p.numel() for p in meta.parameters()) == sum(p.numel() for p in ours.parameters())


def _copy(folder, target):
    shutil.copytree(folder, target)
    return target


def _index(folder):
    return json.loads((folder / "model.safetensors.index.json").read_text())


def test_a_missing_shard_is_named(sharded, tmp_path):
    folder = _copy(sharded["llama"][0], tmp_path / "c")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(
        FileNotFoundError,
        match=rf"shard {shard.name} named in .*index\.json is "
        r"missing \(it holds \d+ tensor",
    ):
        load_llama(folder)


def test_a_shard_that_disagrees_with_the_index_is_named(sharded, tmp_path):
    folder = _copy(sharded["gpt2"][0], tmp_path / "c")
    index = _index(folder)
    key = sorted(index["weight_map"])[0]
    home = index["weight_map"][key]
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != home)
    index["weight_map"][key] = other  # the index now places the key in a shard without it
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    # whichever of the two shards is opened first is named, with the key
    with pytest.raises(
        ValueError,
        match=rf"shard .*({home}: holds|{other}: lacks) 1 key\(s\) "
        rf"the index (does not place|places) in it: \['{key}'\]",
    ):
        load_gpt2(folder)


def test_a_key_in_two_shards_and_a_broken_index_are_refused(sharded, tmp_path):
    folder = _copy(sharded["gpt2"][0], tmp_path / "c")
    index = _index(folder)
    key = sorted(index["weight_map"])[0]
    home = index["weight_map"][key]
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != home)
    tensors = load_file(folder / other)
    tensors[key] = load_file(folder / home)[key]
    save_file(tensors, folder / other)
    index["weight_map"][key] = other
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"holds 1 key\(s\) the index does not place in it"):
        load_gpt2(folder)
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"index\.json has no 'weight_map'"):
        load_gpt2(folder)
    (folder / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ValueError, match=r"index\.json is not valid JSON"):
        load_gpt2(folder)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {key: "../model.safetensors"}})
    )
    with pytest.raises(ValueError, match=r"names a shard outside its folder"):
        load_gpt2(folder)


def test_no_weights_at_all_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        FileNotFoundError,
        match=r"no model\.safetensors \(nor model\.safetensors"
        r"\.index\.json\)",
    ):
        load_llama(tmp_path)


def test_the_index_is_ignored_beside_one_file(sharded, tmp_path):
    """A folder with both keeps to model.safetensors, as transformers does."""
    folder, hf = sharded["llama"]
    single = tmp_path / "single"
    _save(hf, single)
    shutil.copy(folder / "model.safetensors.index.json", single)
    _assert_same_logits(hf, load_llama(single), _tokens(1, 7))


def test_llama_runs_past_max_position_embeddings_as_the_reference_does(sharded):
    """RoPE has no table of positions: transformers runs on past max_position_embeddings
    (40 here), and so does the book's model, cached or not."""
    folder, hf = sharded["llama"]
    assert hf.config.max_position_embeddings == 40
    ours = load_llama(folder)
    assert ours.max_len is None
    _assert_same_logits(hf, ours, _tokens(2, 57))
    prompt = _tokens(1, 30, seed=1)
    with torch.no_grad():
        expected = hf.generate(
            prompt, max_new_tokens=25, do_sample=False, attention_mask=torch.ones_like(prompt)
        )[0, 30:].tolist()
    assert generate(ours, prompt, 25, eos=NEVER)[0] == expected
    assert generate(ours, prompt, 25, eos=NEVER, use_cache=False)[0] == expected


def test_gpt2_refuses_positions_past_its_table(sharded):
    """GPT-2's positions are rows of a learned table: past n_positions there is nothing."""
    ours = load_gpt2(sharded["gpt2"][0])
    with pytest.raises(ValueError, match=r"longer than max_len=40"):
        ours(_tokens(1, 41))


# ------------------------------------------------------------------------ scaled RoPE

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


def _scaled_llama(kind, folder):
    """A Llama checkpoint of ``kind``'s scaling (rope_theta 500, 40 positions), written and
    loaded back by transformers, so the reference reads the config exactly as saved."""
    lib = pytest.importorskip("transformers")
    torch.manual_seed(5)
    params = {"rope_theta": 500.0, **SCALINGS[kind]}
    model = _llama(num_attention_heads=4, num_key_value_heads=2, rope_parameters=params)
    model.save_pretrained(folder)
    return lambda: _fresh(lib, folder)


def _fresh(lib, folder):
    """A new reference model: dynamic scaling keeps state between calls in transformers."""
    model = lib.LlamaForCausalLM.from_pretrained(folder).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_rope_frequencies_equal_the_reference(kind, tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from utils.rope_scaling import rope_config, rope_frequencies

    config = _scaled_llama(kind, tmp_path)().config
    theta, scaling = rope_config(json.loads((tmp_path / "config.json").read_text()), 40)
    assert theta == 500.0 and scaling["rope_type"] == kind
    for length in (None, 30, 41, 97):
        expected, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=length)
        assert attention_factor == 1.0
        got = rope_frequencies(8, theta, scaling, length)
        plain = rope_frequencies(8, theta)
        torch.testing.assert_close(got, expected.double(), rtol=1e-6, atol=0)
        changed = not torch.allclose(got, plain)
        assert changed == (kind != "dynamic" or (length or 0) > 40), (kind, length)


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_scaled_rope_checkpoints_give_the_reference_logits_and_tokens(kind, tmp_path):
    reference = _scaled_llama(kind, tmp_path)
    ours = load_llama(tmp_path)
    assert ours.blocks[0].attn.scaling["rope_type"] == kind
    for length in (9, 57):  # within and past max_position_embeddings (40)
        _assert_same_logits(reference(), ours, _tokens(2, length, seed=length))
    prompt = _tokens(1, 30, seed=2)
    with torch.no_grad():
        expected = (
            reference()
            .generate(
                prompt, max_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(prompt)
            )[0, 30:]
            .tolist()
        )
    assert generate(ours, prompt, 20, eos=NEVER)[0] == expected
    if kind != "dynamic":  # dynamic: each cached step rotates by that step's frequencies
        assert generate(ours, prompt, 20, eos=NEVER, use_cache=False)[0] == expected


def test_the_scaling_matters(tmp_path):
    """The same weights read as plain RoPE give other logits past a few positions: the check
    above could fail."""
    hf = _scaled_llama("linear", tmp_path)()  # read before the config is changed
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(AssertionError):
        _assert_same_logits(hf, load_llama(tmp_path), _tokens(1, 20))


def _with_inv_freq(folder, target, scale=1.0):
    """Add the per-layer inv_freq buffers older transformers stored, computed as it did."""
    tensors = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    d_k = config["hidden_size"] // config["num_attention_heads"]
    theta = config["rope_parameters"]["rope_theta"]
    inv = 1.0 / theta ** (torch.arange(0, d_k, 2).float() / d_k) * scale
    for i in range(config["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = inv.clone()
    target.mkdir()
    save_file(tensors, target / "model.safetensors")
    shutil.copy(folder / "config.json", target)
    return target


def test_older_files_with_inv_freq_buffers_load_and_are_checked(tmp_path):
    torch.manual_seed(6)
    hf = _save(_llama(num_attention_heads=4, num_key_value_heads=2), tmp_path / "plain")
    folder = _with_inv_freq(tmp_path / "plain", tmp_path / "old")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # buffers that agree with the config: no warning
        _assert_same_logits(hf, load_llama(folder), _tokens(2, 9))
    assert sum(p.numel() for p in load_llama(folder, device="meta").parameters()) > 0
    # buffers that disagree are ignored, as transformers ignores them, and named in a warning
    wrong = _with_inv_freq(tmp_path / "plain", tmp_path / "wrong", scale=0.5)
    with pytest.warns(
        UserWarning,
        match=r"2 stored rotary_emb\.inv_freq buffer\(s\) \(such as model\.layers\.\d+\.self_attn"
        r"\.rotary_emb\.inv_freq\) hold RoPE frequencies that differ .*rope_theta=500.* by up "
        r"to 5\.0e-01 relative; they are ignored",
    ):
        ours = load_llama(wrong)
    _assert_same_logits(transformers.LlamaForCausalLM.from_pretrained(wrong), ours, _tokens(2, 9))
    # a buffer of another width says the file's heads are not the config's: refused
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(3)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"rotary_emb\.inv_freq has shape \(3,\), expected \(4,\)"):
        load_llama(folder)


def test_a_meta_load_of_an_older_file_reads_nothing(tmp_path):
    """The inv_freq buffers are dropped on meta too, by shape alone."""
    torch.manual_seed(6)
    _save(_llama(num_attention_heads=4, num_key_value_heads=2), tmp_path / "plain")
    folder = _with_inv_freq(tmp_path / "plain", tmp_path / "old")
    model = load_llama(folder, device="meta")
    assert all(p.is_meta for p in model.parameters())


# ------------------------------------------------------------- config against tensors


def _edited(source, target, **fields):
    """A copy with config fields changed; head_dim, which transformers 5 writes, is left out
    where the heads change, so that it follows hidden_size / num_attention_heads."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    if {"num_attention_heads", "hidden_size"} & set(fields):
        config.pop("head_dim", None)
    config.update(fields)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """{family: (folder, transformers model)}: GPT-2 (2 heads, n_inner 128, 2 layers, 40
    positions) and a
    multi-head Llama (4 heads of 8, as many key/value heads) and a grouped one (2 kv heads)."""
    torch.manual_seed(7)
    made = {}
    for name, model in (
        ("gpt2", _gpt2(n_embd=32, n_head=2)),
        ("llama-gqa", _llama(num_attention_heads=4, num_key_value_heads=2)),
        ("llama-mha", _llama(num_attention_heads=4, num_key_value_heads=4)),
    ):
        folder = tmp_path_factory.mktemp(name)
        made[name] = (folder, _save(model, folder))
    return made


FIELD_ERRORS = [
    (
        "gpt2",
        {"n_inner": 40},
        r"n_inner=40, but the tensors hold 128 columns in "
        r"transformer\.h\.0\.mlp\.c_fc\.weight",
    ),
    ("gpt2", {"n_layer": 3}, r"n_layer=3, but the tensors hold layers 0 to 1 \(2 numbered\)"),
    (
        "gpt2",
        {"vocab_size": 100},
        r"vocab_size=100, but the tensors hold 101 rows in "
        r"transformer\.wte\.weight",
    ),
    ("gpt2", {"n_positions": 64}, r"n_positions=64, but the tensors hold 40 rows"),
    (
        "llama-gqa",
        {"num_key_value_heads": 1},
        r"num_attention_heads=4 and num_key_value_heads=1, "
        r"so heads of 8 .* 8 rows in model\.layers\.0\."
        r"self_attn\.k_proj\.weight, but it has 16: 2 "
        r"key/value heads of 8",
    ),
    (
        "llama-gqa",
        {"num_attention_heads": 2},
        r"num_attention_heads=2 and num_key_value_heads=2, "
        r"so heads of 16 .* but it has 16: 1 key/value",
    ),
    (
        "llama-gqa",
        {"intermediate_size": 64},
        r"intermediate_size=64, but the tensors hold 56 "
        r"rows in model\.layers\.0\.mlp\.gate_proj\.weight",
    ),
    (
        "llama-gqa",
        {"num_hidden_layers": 1},
        r"num_hidden_layers=1, but the tensors hold layers "
        r"0 to 1",
    ),
    ("llama-gqa", {"hidden_size": 48}, r"hidden_size=48, but the tensors hold 32 columns"),
]


@pytest.mark.parametrize("name, fields, message", FIELD_ERRORS)
def test_a_config_its_tensors_contradict_is_refused_naming_the_field(
    small, tmp_path, name, fields, message
):
    folder = _edited(small[name][0], tmp_path / "c", **fields)
    with pytest.raises(ValueError, match=message):
        (load_gpt2 if name == "gpt2" else load_llama)(folder)
    with pytest.raises(ValueError, match=message):  # from the headers alone
        (load_gpt2 if name == "gpt2" else load_llama)(folder, device="meta")


@pytest.mark.parametrize("name, field", [("gpt2", "n_head"), ("llama-mha", "num_attention_heads")])
def test_what_no_tensor_records_loads_and_only_the_logits_show(small, tmp_path, name, field):
    """With as many key/value heads as query heads, no shape says how d splits into heads: a
    wrong head count loads, and the logits check is what catches it."""
    source, hf = small[name]
    fields = {field: 4} if name == "gpt2" else {field: 2, "num_key_value_heads": 2}
    folder = _edited(source, tmp_path / "c", **fields)
    ours = (load_gpt2 if name == "gpt2" else load_llama)(folder)
    with pytest.raises(AssertionError):
        _assert_same_logits(hf, ours, _tokens(1, 9))
    _assert_same_logits(hf, (load_gpt2 if name == "gpt2" else load_llama)(source), _tokens(1, 9))


def test_a_renamed_key_is_named_with_its_missing_partner(small, tmp_path):
    source = small["llama-gqa"][0]
    target = tmp_path / "c"
    target.mkdir()
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.1.self_attn.q_projection.weight"] = tensors.pop(
        "model.layers.1.self_attn.q_proj.weight"
    )
    save_file(tensors, target / "model.safetensors")
    shutil.copy(source / "config.json", target)
    with pytest.raises(
        ValueError,
        match=r"holds 1 unknown key\(s\) .*\['model\.layers\.1\.self_attn\.q_projection\.weight'\]"
        r"; and lacks 1 key\(s\) the model needs: "
        r"\['model\.layers\.1\.self_attn\.q_proj\.weight'\]",
    ):
        load_llama(target)


def test_tensors_are_listed_in_the_files_order(sharded, small):
    """read_checkpoint lists the tensors as the file does (chapter 14 prints them so); a
    sharded checkpoint's, shard after shard."""
    from safetensors import safe_open

    from utils.pretrained import read_checkpoint

    folder = small["gpt2"][0]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        in_file = list(f.keys())
    assert list(read_checkpoint(folder)[1]) == in_file
    folder = sharded["llama"][0]
    in_shards = []
    for shard in sorted(folder.glob("model-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            in_shards += list(f.keys())
    assert list(read_checkpoint(folder)[1]) == in_shards
