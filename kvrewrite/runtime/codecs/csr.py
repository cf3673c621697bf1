"""`csr`: each KV head's latent vector as a sparse combination of dictionary atoms (CSR).

The dictionaries (one per layer, side and KV head, [atoms, rank], unit-norm rows) are trained at compile time
on calibration latents (`fitting.fit_csr_dictionaries`); at run time matching pursuit picks `sparsity` atoms
per vector and the cache stores their indices (uint8 for <= 256 atoms, else int16) and float16 coefficients.
"""

from __future__ import annotations

import torch

from kvrewrite.runtime.codecs.base import LayerCodec
from kvrewrite.runtime.codecs.config import CodecConfig
from kvrewrite.runtime.codecs.packing import META_DTYPE
from kvrewrite.errors import CorruptCheckpointError


def dictionary_name(layer_idx: int, side: str, head: int) -> str:
    return f"csr.layer{layer_idx}.{side}.head{head}"


def matching_pursuit(x: torch.Tensor, atoms: torch.Tensor, sparsity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, r], atoms [N, r] (unit rows) -> indices [M, s] (long), float16 coefficients [M, s]."""
    residual = x.clone()
    indices, coefs = [], []
    for _ in range(sparsity):
        corr = residual @ atoms.T
        best = corr.abs().argmax(dim=-1, keepdim=True)
        # Rounded to float16 first, so the residual tracks what decode will rebuild.
        coef = corr.gather(-1, best).to(META_DTYPE)
        residual -= coef.float() * atoms[best.squeeze(-1)]
        indices.append(best)
        coefs.append(coef)
    return torch.cat(indices, dim=-1), torch.cat(coefs, dim=-1)


def reconstruct(indices: torch.Tensor, coefs: torch.Tensor, atoms: torch.Tensor) -> torch.Tensor:
    return (coefs.float().unsqueeze(-1) * atoms[indices.long()]).sum(-2)


class CsrCodec(LayerCodec):
    def __init__(self, config: CodecConfig, key_ranks, value_ranks, dictionaries: dict[str, list[torch.Tensor | None]]):
        super().__init__(config, key_ranks, value_ranks)
        self.sparsity = int(config.params["sparsity"])
        self.atoms = int(config.params["atoms"])
        self.index_dtype = torch.uint8 if self.atoms <= 256 else torch.int16
        self.dictionaries = dictionaries  # side -> per head [atoms, rank] (None for rank-0 heads)

    @classmethod
    def for_layer(cls, config, layer_idx, key_ranks, value_ranks, tables):
        dictionaries = {}
        for side, ranks in (("key", key_ranks), ("value", value_ranks)):
            heads = []
            for h, r in enumerate(ranks):
                if r == 0:
                    heads.append(None)
                    continue
                name = dictionary_name(layer_idx, side, h)
                atoms = tables.get(name)
                if atoms is None or tuple(atoms.shape) != (int(config.params["atoms"]), r):
                    found = "missing" if atoms is None else f"shape {tuple(atoms.shape)}"
                    raise CorruptCheckpointError(
                        f"csr dictionary {name} is {found}, expected [{int(config.params['atoms'])}, {r}]: CSR dictionaries "
                        "are trained at compile time for the compiled ranks; recompile with `kv_codec=csr` at this rate"
                    )
                heads.append(atoms.float())
            dictionaries[side] = heads
        return cls(config, key_ranks, value_ranks, dictionaries)

    def _active(self, side: str) -> list[int]:
        return [h for h, r in enumerate(self.ranks[side]) if r > 0]

    def encode(self, x, side):
        batch, n, g, _ = x.shape
        offsets, indices, coefs = self.offsets[side], [], []
        for h in self._active(side):
            atoms = self.dictionaries[side][h].to(x.device)
            xh = x[..., offsets[h] : offsets[h + 1]].reshape(-1, atoms.shape[1]).float()
            idx, coef = matching_pursuit(xh, atoms, self.sparsity)
            indices.append(idx.reshape(batch, n, g, -1))
            coefs.append(coef.reshape(batch, n, g, -1))
        return {"index": torch.cat(indices, -1).to(self.index_dtype), "coef": torch.cat(coefs, -1)}

    def decode(self, coded, side):
        batch, n, g, _ = coded["coef"].shape
        pieces, s = [], self.sparsity
        for j, h in enumerate(self._active(side)):
            atoms = self.dictionaries[side][h].to(coded["coef"].device)
            pieces.append(reconstruct(coded["index"][..., j * s : (j + 1) * s], coded["coef"][..., j * s : (j + 1) * s], atoms))
        if not pieces:
            return coded["coef"].new_zeros(batch, n, g, 0, dtype=torch.float32)
        return torch.cat(pieces, dim=-1)

    def block_bytes(self, side):
        per_atom = torch.empty((), dtype=self.index_dtype).element_size() + 2
        return self.block_tokens * len(self._active(side)) * self.sparsity * per_atom
