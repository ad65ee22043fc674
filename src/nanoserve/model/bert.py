"""BERT-family encoders (`BertModel`, and `BertForSequenceClassification` for cross-encoders) as
straight-line tensor code over packed sequences: word + absolute position + token-type
embeddings, then layers of bidirectional attention (each sequence attends to itself alone: no
padding, no mask) and a GELU MLP, each followed by a residual LayerNorm (post-norm). Its config
is read in bert_config.py. Owns its weights; no KV cache: an encoder's forward keeps nothing.

Batch invariance: a sequence's vector is bitwise the same alone or in any batch. Attention,
LayerNorm and the activation work row by row or sequence by sequence; a CPU matmul does not (its
result for a row changes with the number of rows: another kernel, another summation order), so
every matmul runs on tiles of a fixed TILE_ROWS rows, the last one padded: the same shapes
whatever the batch, and a row's sums never depend on the others' (tests/test_embeddings.py). The
tiles go to oneDNN with each weight prepacked once (model/linear.py), for its packing's row
count, the bias and the residual or activation fused into the call; a tile's attention output
projection and norm, and its whole MLP, run before the next tile's (the MLP's activations stay
in the cache), each tile's result written into buffers made once per forward.
bench/bench_embedding_tiles.py measures the tiles against one matmul over the batch,
bench/bench_embeddings.py the encoder against sentence-transformers and llama.cpp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoserve.model.bert_config import BertConfig
from nanoserve.model.config import CheckpointError, read_json
from nanoserve.model.linear import PACK_ROWS_HINT, Linear
from nanoserve.model.loader import read_checkpoint

# config.json's hidden_act -> the activation transformers' ACT2FN computes for it, as oneDNN's
# post-op (its name, its algorithm: F.gelu's `approximate`).
ACTIVATIONS = {
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
}


# Rows of each matmul call: the rows oneDNN's packed weights are blocked for.
TILE_ROWS = PACK_ROWS_HINT


@dataclass
class BertLayer:
    qkv: Linear  # [3 * hidden, hidden]: query, key, value fused at load
    qkv_bias: torch.Tensor
    o: Linear  # [hidden, hidden]
    o_bias: torch.Tensor
    attn_norm: tuple[torch.Tensor, torch.Tensor]  # LayerNorm weight, bias
    up: Linear  # [intermediate, hidden]
    up_bias: torch.Tensor
    down: Linear  # [hidden, intermediate]
    down_bias: torch.Tensor
    mlp_norm: tuple[torch.Tensor, torch.Tensor]


class Bert:
    def __init__(self, config: BertConfig, w: dict[str, torch.Tensor], source: str) -> None:
        """The encoder of `config` with weights `w` under transformers' BertModel names (on the
        CPU, in one float dtype); `source` names the checkpoint in errors."""
        self.config = c = config
        try:
            self.word, self.position = (
                w["embeddings.word_embeddings.weight"],
                w["embeddings.position_embeddings.weight"],
            )
            self.token_type = w["embeddings.token_type_embeddings.weight"]
            self.embed_norm = _norm(w, "embeddings.LayerNorm")
            self.layers = [_layer(w, f"encoder.layer.{i}.") for i in range(c.num_layers)]
            self.classifier = None
            if c.num_labels:  # BERT's pooler (tanh of a dense of [CLS]), then the classifier
                self.classifier = (
                    Linear(w["pooler.dense.weight"]), w["pooler.dense.bias"],
                    Linear(w["classifier.weight"]), w["classifier.bias"],
                )  # fmt: skip
        except KeyError as e:
            raise CheckpointError(f"{source}: checkpoint has no tensor {e.args[0]}") from None
        self.act = ACTIVATIONS[c.hidden_act]

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype) -> Bert:
        """The encoder of a checkpoint directory, its weights in `dtype` on the CPU."""
        path = Path(path)
        try:
            config = BertConfig.from_dict(read_json(path / "config.json"))
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{path / 'config.json'}: {e}") from None
        w = {_strip(k): t for k, t in read_checkpoint(path, dtype).items()}
        return cls(config, w, str(path))

    def forward(self, ids: torch.Tensor, types: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The last hidden states [num_tokens, hidden] of packed sequences: `ids` and `types`
        [num_tokens], each sequence's positions from 0; `lengths` partition the rows."""
        c = self.config
        positions = torch.cat([torch.arange(n) for n in lengths])
        h = self.word[ids] + self.token_type[types] + self.position[positions]
        h = _layer_norm(h, self.embed_norm, c.layer_norm_eps)
        # Buffers made once for every layer (fresh ones would be faulted in page by page),
        # and h updated in place: a tile's rows are read before they are written.
        qkv = h.new_empty(h.shape[0], 3 * c.hidden_size)
        a = torch.empty_like(h)
        for layer in self.layers:
            _by_tiles(lambda x, lay=layer: _tile(x, lay.qkv, lay.qkv_bias), h, out=qkv)
            self._attention(qkv, lengths, a)
            _by_tiles(lambda x, r, lay=layer: self._attention_out(x, r, lay), a, h, out=h)
            _by_tiles(lambda x, lay=layer: self._mlp(x, lay), h, out=h)
        return h

    def _attention(self, qkv: torch.Tensor, lengths: list[int], a: torch.Tensor) -> None:
        """Into `a`: each sequence attends to itself alone, [1, heads, n, head_dim] (4-D, so
        that torch takes its flash kernel)."""
        c = self.config
        heads, head_dim = c.num_heads, c.hidden_size // c.num_heads
        start = 0
        for n in lengths:
            q, k, v = qkv[start : start + n].view(1, n, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v)
            a[start : start + n] = out[0].transpose(0, 1).reshape(n, c.hidden_size)
            start += n

    def _attention_out(self, a: torch.Tensor, h: torch.Tensor, layer: BertLayer) -> torch.Tensor:
        """A tile's attention output projected, added to its residual h, normed."""
        out = _tile(a, layer.o, layer.o_bias, residual=h)
        return _layer_norm(out, layer.attn_norm, self.config.layer_norm_eps)

    def _mlp(self, h: torch.Tensor, layer: BertLayer) -> torch.Tensor:
        """A tile's MLP, residual and norm: its [TILE_ROWS, intermediate] activations stay in
        the cache, never written out for the whole batch."""
        up = _tile(h, layer.up, layer.up_bias, act=self.act)
        out = _tile(up, layer.down, layer.down_bias, residual=h)
        return _layer_norm(out, layer.mlp_norm, self.config.layer_norm_eps)

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """The classifier's logits [rows, num_labels] (float32) from the [CLS] rows' states."""
        assert self.classifier is not None
        pool_w, pool_b, w, b = self.classifier
        return _linear(torch.tanh(_linear(first_rows, pool_w, pool_b)), w, b).float()


def _linear(x: torch.Tensor, weight: Linear, bias: torch.Tensor) -> torch.Tensor:
    """x @ weight.T + bias in tiles of TILE_ROWS rows (see the module's docstring)."""
    return _by_tiles(lambda tile: _tile(tile, weight, bias), x)


def _by_tiles(
    fn: Callable[..., torch.Tensor], *inputs: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fn over tiles of TILE_ROWS rows of `inputs` (the last padded with zeros), each tile's
    result written to `out` (made if None) as it is made, while still in the cache."""
    n = inputs[0].shape[0]
    for start in range(0, n, TILE_ROWS):
        rows = min(TILE_ROWS, n - start)
        y = fn(*(_pad(x[start : start + rows]) for x in inputs))
        if out is None:
            out = y.new_empty(n, y.shape[1])
        out[start : start + rows] = y[:rows]
    assert out is not None
    return out


def _pad(tile: torch.Tensor) -> torch.Tensor:
    pad = TILE_ROWS - tile.shape[0]
    return torch.cat([tile, tile.new_zeros(pad, tile.shape[1])]) if pad else tile


def _tile(
    x: torch.Tensor, weight: Linear, bias: torch.Tensor, residual: torch.Tensor | None = None,
    act: tuple[str, str] | None = None,
) -> torch.Tensor:  # fmt: skip
    """One tile through oneDNN's packed weight, the bias, residual or activation fused into the
    call (elementwise: a row's values stay its own), or through F.linear where oneDNN cannot
    take the weight's dtype."""
    packed, ops = weight.packed, torch.ops.mkldnn
    if packed is not None and residual is not None:
        return ops._linear_pointwise.binary(x, residual, packed, bias, "add")
    if packed is not None:
        name, algorithm = act or ("none", "")
        return ops._linear_pointwise(x, packed, bias, name, [None] if act is None else [],
                                     algorithm)  # fmt: skip
    y = F.linear(x, weight.weight, bias)
    if residual is not None:
        return y + residual
    if act is None:
        return y
    return F.relu(y) if act[0] == "relu" else F.gelu(y, approximate=act[1])


def _strip(name: str) -> str:
    """A classifier checkpoint's encoder tensors are under bert.; BertModel's are not."""
    return name.removeprefix("bert.")


def _norm(w: dict[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    return w[prefix + ".weight"], w[prefix + ".bias"]


def _layer(w: dict[str, torch.Tensor], p: str) -> BertLayer:
    attn = p + "attention.self."
    return BertLayer(
        qkv=Linear(torch.cat([w[attn + x + ".weight"] for x in ("query", "key", "value")])),
        qkv_bias=torch.cat([w[attn + x + ".bias"] for x in ("query", "key", "value")]),
        o=Linear(w[p + "attention.output.dense.weight"]),
        o_bias=w[p + "attention.output.dense.bias"],
        attn_norm=_norm(w, p + "attention.output.LayerNorm"),
        up=Linear(w[p + "intermediate.dense.weight"]),
        up_bias=w[p + "intermediate.dense.bias"],
        down=Linear(w[p + "output.dense.weight"]),
        down_bias=w[p + "output.dense.bias"],
        mlp_norm=_norm(w, p + "output.LayerNorm"),
    )


def _layer_norm(
    x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor], eps: float
) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], norm[0], norm[1], eps)
