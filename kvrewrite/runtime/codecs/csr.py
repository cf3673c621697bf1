"""`csr`: each KV head's latent vector as a sparse combination of dictionary atoms (CSR).

The dictionaries (one per layer, side and KV head, [atoms, rank], unit-norm rows) are trained at compile time
on calibration latents (`CsrCodec.fit_tables`: k-means initialisation, then alternating matching pursuit and
least-squares refits of the atoms); at run time matching pursuit picks `sparsity` atoms
per vector and the cache stores their indices (uint8 for <= 256 atoms, else int16) and float16 coefficients.
"""

from __future__ import annotations

import torch

from kvrewrite.errors import CorruptCheckpointError, InvalidArgumentError
from kvrewrite.runtime.codecs.base import LayerCodec
from kvrewrite.runtime.codecs.config import CodecConfig
from kvrewrite.runtime.codecs.packing import META_DTYPE
from kvrewrite.runtime.codecs.registry import register_codec


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


@register_codec
class CsrCodec(LayerCodec):
    name = "csr"
    # atoms: dictionary size per layer, side and KV head; sparsity: matching-pursuit atoms per vector.
    defaults = {"atoms": 256, "sparsity": 8, "kmeans_iterations": 10, "fit_iterations": 5, "group_size": 32, "residual": 32}
    fit_description = "fitting CSR dictionaries"

    @classmethod
    def validate(cls, params):
        super().validate(params)
        if params["sparsity"] < 1:
            raise InvalidArgumentError(f"codec csr: sparsity must be >= 1, got {params['sparsity']}")
        if not 2 <= params["atoms"] <= 32768:
            raise InvalidArgumentError(f"codec csr: atoms must be in [2, 32768], got {params['atoms']}")

    @classmethod
    def fit_tables(cls, config, latents, key_ranks, value_ranks, *, budget_bits=None, weights=None, progress=None):
        """One dictionary per layer, side and KV head of nonzero rank, trained on that head's latents."""
        p = config.params
        tables = {}
        for i, layer in enumerate(latents):
            for side, ranks in (("key", key_ranks[i]), ("value", value_ranks[i])):
                start = 0
                for h, r in enumerate(ranks):
                    if r > 0:
                        x = layer[side][:, start : start + r]
                        tables[dictionary_name(i, side, h)] = fit_dictionary(
                            x, int(p["atoms"]), int(p["sparsity"]), int(p["kmeans_iterations"]), int(p["fit_iterations"]),
                            seed=i)
                    start += r
            if progress is not None:
                progress()
        return tables, {}

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


# ---- compile-time fitting: dictionaries by k-means initialisation and least-squares refits ---------------------


def kmeans(x: torch.Tensor, k: int, iterations: int, generator: torch.Generator) -> torch.Tensor:
    """Plain Lloyd iterations; empty clusters are re-seeded with random points."""
    pick = torch.randint(0, x.shape[0], (k,), generator=generator)
    centers = x[pick].clone()
    for _ in range(iterations):
        dist = x.pow(2).sum(1, keepdim=True) - 2 * x @ centers.T + centers.pow(2).sum(1)
        assign = dist.argmin(1)
        sums = torch.zeros_like(centers).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k).float()
        empty = counts == 0
        centers = sums / counts.clamp_min(1).unsqueeze(1)
        if empty.any():
            centers[empty] = x[torch.randint(0, x.shape[0], (int(empty.sum()),), generator=generator)]
    return centers


def normalise_rows(atoms: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    norms = atoms.norm(dim=1, keepdim=True)
    good = norms.squeeze(1) > 1e-8
    out = fallback.clone()
    out[good] = atoms[good] / norms[good]
    return out


def fit_dictionary(x: torch.Tensor, atoms: int, sparsity: int, kmeans_iterations: int, fit_iterations: int,
                   seed: int = 0) -> torch.Tensor:
    """A unit-norm dictionary [atoms, r] for the rows of x [T, r]: k-means centroids, then alternating matching
    pursuit codes and a least-squares refit of the atoms (the fixed point of a gradient loop on ||X - C D||^2)."""
    generator = torch.Generator().manual_seed(seed)
    x = x.float()
    if x.shape[0] < atoms:  # too few calibration vectors: repeat them (k-means re-seeds duplicates anyway)
        x = x.repeat(-(-atoms // x.shape[0]), 1)
    rand = torch.randn(atoms, x.shape[1], generator=generator)
    dictionary = normalise_rows(kmeans(x, atoms, kmeans_iterations, generator), rand / rand.norm(dim=1, keepdim=True))
    ridge = 1e-6 * x.pow(2).mean()
    for _ in range(fit_iterations):
        idx, coef = matching_pursuit(x, dictionary, sparsity)
        codes = torch.zeros(x.shape[0], atoms).scatter_add_(1, idx, coef.float())
        gram = codes.T @ codes + ridge * torch.eye(atoms)
        refit = torch.linalg.solve(gram, codes.T @ x)
        dictionary = normalise_rows(refit, dictionary)  # unused atoms keep their previous direction
    return dictionary
