"""`utils.checkpoint_write.save_gpt2` writes a GPT-2 model of the book's modules back in
``GPT2LMHeadModel``'s format: `load_gpt2` and ``transformers`` both read exactly its weights,
after the book's own training changed them."""

from __future__ import annotations

import json

import pytest
import test_pretrained
import torch
from test_pretrained import checkpoints  # noqa: F401

from utils.checkpoint_write import gpt2_state_dict, save_gpt2
from utils.pretrained import load_gpt2

one_thread = test_pretrained.one_thread  # an autouse fixture: tiny models, one thread


def _tokens(b, n, seed):
    return torch.randint(
        0, test_pretrained.VOCAB, (b, n), generator=torch.Generator().manual_seed(seed)
    )


def _nudged(directory):
    """The checkpoint loaded and changed by a few steps of plain gradient descent, as training
    would change it (every weight, the fused query/key/value views included)."""
    model = load_gpt2(directory).train()
    tokens = torch.randint(
        0, test_pretrained.VOCAB, (4, 12), generator=torch.Generator().manual_seed(0)
    )
    for _ in range(3):
        loss = model(tokens[:, :-1]).log_softmax(-1).gather(-1, tokens[:, 1:, None]).mean()
        model.zero_grad()
        (-loss).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
    return model.eval()


@pytest.mark.parametrize("name", ["gpt2/d32-h2-tied", "gpt2/d48-h4-untied"])
def test_trained_weights_round_trip_through_both_libraries(checkpoints, name, tmp_path):  # noqa: F811
    directory, _ = checkpoints[name]
    model = _nudged(directory)
    config = json.loads((directory / "config.json").read_text())
    save_gpt2(model, tmp_path, config)
    tokens = torch.randint(
        0, test_pretrained.VOCAB, (3, 15), generator=torch.Generator().manual_seed(1)
    )
    hf = test_pretrained._transformers().GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ours, again, theirs = model(tokens), load_gpt2(tmp_path)(tokens), hf(tokens).logits
        before = load_gpt2(directory)(tokens)
    assert (ours - before).abs().max() > 1e-2, "training did not change the model"
    assert torch.equal(again, ours), "load_gpt2 does not read back the same model"
    gap = (theirs - ours).abs().max().item()
    assert gap < 1e-4, f"transformers reads other weights: logits differ by {gap:.2e}"


def test_a_weight_not_transposed_is_caught(checkpoints, tmp_path):  # noqa: F811
    """The round trip can fail: attn.c_proj written as (d_out, d_in), not transposed, keeps
    its shape and changes the logits."""
    directory, _ = checkpoints["gpt2/d32-h2-tied"]
    model = load_gpt2(directory)
    state = gpt2_state_dict(model)
    key = "transformer.h.0.attn.c_proj.weight"  # (d, d): a wrong layout keeps the shape
    state[key] = state[key].T.contiguous()
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    tokens = torch.randint(
        0, test_pretrained.VOCAB, (2, 10), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        assert (load_gpt2(tmp_path)(tokens) - model(tokens)).abs().max() > 1e-3


def test_config_that_does_not_describe_the_model_is_refused(checkpoints, tmp_path):  # noqa: F811
    directory, _ = checkpoints["gpt2/d32-h2-tied"]
    model = load_gpt2(directory)
    config = json.loads((directory / "config.json").read_text())
    with pytest.raises(ValueError, match="n_layer=3, the model has 2"):
        save_gpt2(model, tmp_path, config | {"n_layer": 3})
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        save_gpt2(model, tmp_path, config | {"tie_word_embeddings": False})
    with pytest.raises(TypeError, match="GPT-2 CheckpointLM"):
        save_gpt2(torch.nn.Linear(2, 2), tmp_path, config)
