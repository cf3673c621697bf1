"""`csr`: Cache Sparse Representation (CSR): each KV head's latent vector as a sparse combination of atoms.

What the cache stores, per KV head and token: the vector is cut into `chunks` equal pieces (the last one
zero-padded; the paper's s_n: 1 for keys, 2 for values) and matching pursuit codes each piece with `sparsity`
atoms (the paper's MP level s: 8 for keys, 4 for values), stored as int16 atom indices and float16
coefficients (the paper's layout). The atoms come from two dictionaries:

- offline: one per layer, side and KV head, [atoms, piece width], unit-norm rows, trained at compile time by
  NeuralDict (`CsrCodec.fit_tables`: k-means centroids, then a gradient loop on the reconstruction error
  through the matching-pursuit code plus the paper's adaptive diversity term, atoms renormalised after every
  step);
- online: built from the sequence itself, for the vectors the offline dictionary represents worst. Each coded
  block of G tokens adds `online_per_block` atoms per head: the normalised pieces of that block with the
  largest relative matching-pursuit error against the offline dictionary. They are stored in float16 with the
  block (counted in `block_bytes`), and every later piece of the sequence can use them. An index >= atoms
  counts back from the newest online atom the piece's block can see, so indices stay below 2**15 however long
  the sequence (at most 32767 - atoms online atoms are visible from one block).

The paper's layer merging (one offline dictionary shared by similar adjacent layers) is not done: our latent
bases are per layer (and per-layer ranks differ), so adjacent layers' latents do not share a space.
"""

from __future__ import annotations

import math

import torch

from kvrewrite.errors import CorruptCheckpointError, InvalidArgumentError
from kvrewrite.runtime.codecs.base import LayerCodec
from kvrewrite.runtime.codecs.config import CodecConfig
from kvrewrite.runtime.codecs.packing import META_DTYPE
from kvrewrite.runtime.codecs.registry import register_codec

INDEX_DTYPE = torch.int16  # the paper's index type; online atoms keep indices below 2**15 (see the module text)
INDEX_LIMIT = torch.iinfo(INDEX_DTYPE).max
MP_BLOCKS_AT_ONCE = 64  # blocks coded in one batched matching pursuit (bounds the [pieces, atoms] correlations)


def dictionary_name(layer_idx: int, side: str, head: int) -> str:
    return f"csr.layer{layer_idx}.{side}.head{head}"


def piece_width(rank: int, chunks: int) -> int:
    """Width of one piece when a rank-`rank` vector is cut into `chunks` pieces (the last zero-padded)."""
    return math.ceil(rank / chunks)


def to_pieces(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """[..., r] -> [..., chunks, w]: `chunks` consecutive pieces, the last zero-padded to the common width."""
    r = x.shape[-1]
    w = piece_width(r, chunks)
    if chunks * w != r:
        x = torch.nn.functional.pad(x, (0, chunks * w - r))
    return x.reshape(*x.shape[:-1], chunks, w)


def matching_pursuit(
    x: torch.Tensor, atoms: torch.Tensor, sparsity: int, allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Matching pursuit (the paper's eqs. 2-4): x [..., M, w], atoms [..., K, w] (unit rows, or float16-rounded
    unit rows: the coefficient is the projection <R, d> / |d|^2) -> indices [..., M, s] (long) and float16
    coefficients [..., M, s]. allowed: an optional bool mask broadcastable to [..., M, K] of the atoms a row
    may use. The coefficients are rounded to float16 before the residual update, so the residual is what
    decode leaves."""
    residual = x.clone()
    norms2 = atoms.pow(2).sum(-1).clamp_min(1e-12)  # [..., K]
    indices, coefs = [], []
    for _ in range(sparsity):
        corr = residual @ atoms.transpose(-1, -2)  # [..., M, K]
        score = corr.abs() / norms2.sqrt().unsqueeze(-2)
        if allowed is not None:
            score = score.masked_fill(~allowed, -1.0)
        best = score.argmax(dim=-1, keepdim=True)
        coef = (corr.gather(-1, best) / norms2.unsqueeze(-2).expand_as(corr).gather(-1, best)).to(META_DTYPE)
        residual = residual - coef.float() * _take(atoms, best.squeeze(-1))
        indices.append(best)
        coefs.append(coef)
    return torch.cat(indices, dim=-1), torch.cat(coefs, dim=-1)


def _take(atoms: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """atoms [..., K, w], index [..., M] -> [..., M, w] (atoms[..., index, :] per leading position)."""
    if atoms.dim() == 2:
        return atoms[index]
    expanded = index.unsqueeze(-1).expand(*index.shape, atoms.shape[-1])
    return atoms.expand(*index.shape[:-1], *atoms.shape[-2:]).gather(-2, expanded)


def reconstruct(indices: torch.Tensor, coefs: torch.Tensor, atoms: torch.Tensor) -> torch.Tensor:
    """Sum of coefficient x atom: indices/coefs [..., M, s], atoms [K, w] or [..., K, w] -> [..., M, w]."""
    if atoms.dim() == 2:
        return (coefs.float().unsqueeze(-1) * atoms[indices.long()]).sum(-2)
    m, s = indices.shape[-2:]
    picked = _take(atoms, indices.long().reshape(*indices.shape[:-2], m * s)).reshape(*indices.shape, -1)
    return (coefs.float().unsqueeze(-1) * picked).sum(-2)


@register_codec
class CsrCodec(LayerCodec):
    name = "csr"
    # The paper's CSR-8: keys s = 8 on whole vectors, values s = 4 on each of 2 halves; 256 offline atoms per
    # KV head (its Llama-3 setting); online_per_block: online atoms each block of G tokens adds per head.
    defaults = {
        "atoms": 256,
        "key_sparsity": 8,
        "value_sparsity": 4,
        "key_chunks": 1,
        "value_chunks": 2,
        "online_per_block": 1,
        "epochs": 10,
        "batch": 1024,
        "learning_rate": 0.01,
        "kmeans_iterations": 10,
        "group_size": 32,
        "residual": 32,
    }
    fit_description = "training CSR dictionaries (NeuralDict)"

    @classmethod
    def parse_params(cls, overrides):
        if "sparsity" in overrides:
            raise InvalidArgumentError(
                "codec csr: `sparsity` is now `key_sparsity` and `value_sparsity` (the paper's 8 and 4, values "
                "coded in `value_chunks`=2 halves); a checkpoint compiled with the old csr must be recompiled"
            )
        return super().parse_params(overrides)

    @classmethod
    def validate(cls, params):
        super().validate(params)
        for side in ("key", "value"):
            if params[f"{side}_sparsity"] < 1:
                raise InvalidArgumentError(f"codec csr: {side}_sparsity must be >= 1, got {params[f'{side}_sparsity']}")
            if params[f"{side}_chunks"] < 1:
                raise InvalidArgumentError(f"codec csr: {side}_chunks must be >= 1, got {params[f'{side}_chunks']}")
        if not 2 <= params["atoms"] < INDEX_LIMIT:
            raise InvalidArgumentError(f"codec csr: atoms must be in [2, {INDEX_LIMIT - 1}], got {params['atoms']}")
        if params["online_per_block"] < 0:
            raise InvalidArgumentError(f"codec csr: online_per_block must be >= 0, got {params['online_per_block']}")
        if params["epochs"] < 0 or params["batch"] < 1 or params["learning_rate"] < 0:
            raise InvalidArgumentError("codec csr: epochs >= 0, batch >= 1 and learning_rate >= 0 are required")

    @classmethod
    def fit_tables(cls, config, latents, key_ranks, value_ranks, *, budget_bits=None, weights=None, progress=None):
        """One offline dictionary per layer, side and KV head of nonzero rank, trained by NeuralDict on that
        head's latents cut into pieces."""
        p = config.params
        tables, losses = {}, {"key": [], "value": []}
        for i, layer in enumerate(latents):
            for side, ranks in (("key", key_ranks[i]), ("value", value_ranks[i])):
                start, layer_losses = 0, []
                for h, r in enumerate(ranks):
                    if r > 0:
                        pieces = to_pieces(layer[side][:, start : start + r].float(), int(p[f"{side}_chunks"]))
                        atoms, history = neural_dict(
                            pieces.reshape(-1, pieces.shape[-1]),
                            int(p["atoms"]),
                            int(p[f"{side}_sparsity"]),
                            epochs=int(p["epochs"]),
                            batch=int(p["batch"]),
                            learning_rate=float(p["learning_rate"]),
                            kmeans_iterations=int(p["kmeans_iterations"]),
                            seed=i,
                        )
                        tables[dictionary_name(i, side, h)] = atoms
                        layer_losses.append([round(history[0], 5), round(history[-1], 5)])
                    start += r
                losses[side].append(layer_losses)
            if progress is not None:
                progress()
        # Per layer and head: NeuralDict's relative MSE on its training pieces before and after the gradient loop.
        return tables, {"neuraldict_relative_mse_first_last": losses}

    def __init__(self, config: CodecConfig, key_ranks, value_ranks, dictionaries: dict[str, list[torch.Tensor | None]]):
        super().__init__(config, key_ranks, value_ranks)
        p = config.params
        self.atoms = int(p["atoms"])
        self.sparsity = {side: int(p[f"{side}_sparsity"]) for side in ("key", "value")}
        self.chunks = {side: int(p[f"{side}_chunks"]) for side in ("key", "value")}
        self.online_per_block = int(p["online_per_block"])
        self.online_window = INDEX_LIMIT - self.atoms + 1  # online atoms one block can index (index <= 32767)
        self.dictionaries = dictionaries  # side -> per head [atoms, piece width] (None for rank-0 heads)

    @classmethod
    def for_layer(cls, config, layer_idx, key_ranks, value_ranks, tables):
        dictionaries = {}
        n_atoms = int(config.params["atoms"])
        for side, ranks in (("key", key_ranks), ("value", value_ranks)):
            heads = []
            for h, r in enumerate(ranks):
                if r == 0:
                    heads.append(None)
                    continue
                name = dictionary_name(layer_idx, side, h)
                atoms = tables.get(name)
                expected = (n_atoms, piece_width(r, int(config.params[f"{side}_chunks"])))
                if atoms is None or tuple(atoms.shape) != expected:
                    found = "missing" if atoms is None else f"shape {tuple(atoms.shape)}"
                    raise CorruptCheckpointError(
                        f"csr dictionary {name} is {found}, expected {list(expected)}: CSR dictionaries are trained "
                        "at compile time for the compiled ranks; recompile with `kv_codec=csr` at this rate"
                    )
                heads.append(atoms.float())
            dictionaries[side] = heads
        return cls(config, key_ranks, value_ranks, dictionaries)

    def _active(self, side: str) -> list[int]:
        return [h for h, r in enumerate(self.ranks[side]) if r > 0]

    def _widths(self, side: str) -> list[int]:
        return [piece_width(self.ranks[side][h], self.chunks[side]) for h in self._active(side)]

    # ---- coding ------------------------------------------------------------------------------------------

    def encode(self, x, side):
        return self.encode_next(x, side, None)

    def encode_next(self, x, side, store):
        """Code blocks x [B, n, G, C] that follow `store` (the blocks of this sequence coded before, or None):
        their pieces may use the online atoms of every earlier block and of their own."""
        batch, n, g, _ = x.shape
        offsets, k, s, chunks = self.offsets[side], self.online_per_block, self.sparsity[side], self.chunks[side]
        done = 0 if store is None else store["coef"].shape[1]
        indices, coefs, online = [], [], []
        online_offset = 0
        for h, w in zip(self._active(side), self._widths(side)):
            offline = self.dictionaries[side][h].to(x.device)
            pieces = to_pieces(x[..., offsets[h] : offsets[h + 1]].float(), chunks).reshape(batch, n, g * chunks, w)
            new_atoms = pieces.new_zeros(batch, n, k, w)
            if k:
                new_atoms = self._online_atoms(pieces, offline, s)
                earlier = (
                    store["online"][..., online_offset : online_offset + k * w].float().reshape(batch, -1, w)
                    if store is not None
                    else pieces.new_zeros(batch, 0, w)
                )
                atoms_seen = torch.cat([earlier, new_atoms.reshape(batch, n * k, w)], dim=1)  # [B, P, w]
            idx, coef = [], []
            for lo in range(0, n, MP_BLOCKS_AT_ONCE):
                hi = min(n, lo + MP_BLOCKS_AT_ONCE)
                part = pieces[:, lo:hi]
                if k:
                    i_, c_ = self._code_with_online(part, offline, atoms_seen, done + lo, s)
                else:
                    i_, c_ = matching_pursuit(part, offline, s)
                idx.append(i_)
                coef.append(c_)
            indices.append(torch.cat(idx, 1).reshape(batch, n, g, chunks * s))
            coefs.append(torch.cat(coef, 1).reshape(batch, n, g, chunks * s))
            online.append(new_atoms.reshape(batch, n, k * w))
            online_offset += k * w
        coded = {"index": torch.cat(indices, -1).to(INDEX_DTYPE), "coef": torch.cat(coefs, -1)}
        if k:
            coded["online"] = torch.cat(online, -1).to(META_DTYPE)
        return coded

    def _online_atoms(self, pieces: torch.Tensor, offline: torch.Tensor, s: int) -> torch.Tensor:
        """The block's `online_per_block` worst-represented pieces [B, n, V, w] (largest relative matching-pursuit
        error against the offline dictionary), normalised and rounded to float16 as stored -> [B, n, k, w]."""
        idx, coef = matching_pursuit(pieces, offline, s)
        error = (pieces - reconstruct(idx, coef, offline)).pow(2).sum(-1)
        energy = pieces.pow(2).sum(-1)
        relative = error / energy.clamp_min(1e-30)
        worst = relative.topk(min(self.online_per_block, pieces.shape[2]), dim=-1).indices  # [B, n, k]
        chosen = pieces.gather(2, worst.unsqueeze(-1).expand(*worst.shape, pieces.shape[-1]))
        norms = chosen.norm(dim=-1, keepdim=True)
        atoms = torch.where(norms > 0, chosen / norms.clamp_min(1e-30), torch.zeros_like(chosen))
        if worst.shape[-1] < self.online_per_block:  # blocks of fewer pieces than online atoms: zero atoms
            atoms = torch.nn.functional.pad(atoms, (0, 0, 0, self.online_per_block - worst.shape[-1]))
        return atoms.to(META_DTYPE).float()

    def _code_with_online(self, pieces, offline, atoms_seen, first_block: int, s: int):
        """Matching pursuit of pieces [B, m, V, w] (blocks first_block.. of the sequence) over the offline atoms
        and the online atoms [B, P, w] each block can see; online indices count back from the block's newest."""
        batch, m, v, w = pieces.shape
        k, n_off = self.online_per_block, offline.shape[0]
        newest = (first_block + torch.arange(m, device=pieces.device) + 1) * k - 1  # [m]
        position = torch.arange(atoms_seen.shape[1], device=pieces.device)  # [P]
        back = newest[:, None] - position[None, :]  # [m, P]: how far back from the block's newest atom
        visible = (back >= 0) & (back < self.online_window)
        # Only the online atoms some block here can see take part (earlier ones are out of every window).
        lo_p = max(0, int(newest[0]) - self.online_window + 1)
        hi_p = int(newest[-1]) + 1
        atoms = torch.cat([offline.expand(batch, n_off, w), atoms_seen[:, lo_p:hi_p]], dim=1)  # [B, K, w]
        allowed = torch.cat([torch.ones(m, n_off, dtype=torch.bool, device=pieces.device), visible[:, lo_p:hi_p]], 1)
        flat = pieces.reshape(batch, m * v, w)
        allowed = allowed[:, None, :].expand(m, v, allowed.shape[-1]).reshape(1, m * v, -1)
        idx, coef = matching_pursuit(flat, atoms, s, allowed)
        # Stored index: offline atoms as they are, online ones as atoms + (steps back from the block's newest).
        block_newest = newest[:, None].expand(m, v).reshape(1, m * v, 1)
        online_pos = idx - n_off + lo_p
        idx = torch.where(idx < n_off, idx, n_off + (block_newest - online_pos))
        return idx.reshape(batch, m, v, s), coef.reshape(batch, m, v, s)

    def decode(self, coded, side):
        batch, n, g, _ = coded["coef"].shape
        pieces_out, s, chunks, k = [], self.sparsity[side], self.chunks[side], self.online_per_block
        col, online_offset = 0, 0
        for h, w in zip(self._active(side), self._widths(side)):
            offline = self.dictionaries[side][h].to(coded["coef"].device)
            idx = coded["index"][..., col : col + chunks * s].long().reshape(batch, n, g * chunks, s)
            coef = coded["coef"][..., col : col + chunks * s].reshape(batch, n, g * chunks, s)
            col += chunks * s
            if k:
                online = coded["online"][..., online_offset : online_offset + k * w].float().reshape(batch, n * k, w)
                online_offset += k * w
                newest = (torch.arange(n, device=idx.device) + 1) * k - 1
                position = (newest[None, :, None, None] - (idx - self.atoms)).clamp(0, n * k - 1)
                from_online = reconstruct(
                    position.reshape(batch, n * g * chunks, s),
                    torch.where(idx >= self.atoms, coef.float(), 0.0).reshape(batch, -1, s),
                    online,
                ).reshape(batch, n, g * chunks, w)
                from_offline = reconstruct(
                    idx.clamp(max=self.atoms - 1), torch.where(idx < self.atoms, coef.float(), 0.0), offline
                )
                piece = from_offline + from_online
            else:
                piece = reconstruct(idx, coef, offline)
            pieces_out.append(piece.reshape(batch, n, g, chunks * w)[..., : self.ranks[side][h]])
        if not pieces_out:
            return coded["coef"].new_zeros(batch, n, g, 0, dtype=torch.float32)
        return torch.cat(pieces_out, dim=-1)

    def block_bytes(self, side):
        """Per block: G tokens x heads x chunks x sparsity x (int16 index + float16 coefficient), plus the
        block's online atoms (online_per_block x piece width float16 values per head)."""
        heads = len(self._active(side))
        codes = self.block_tokens * heads * self.chunks[side] * self.sparsity[side] * (INDEX_DTYPE.itemsize + 2)
        return codes + self.online_per_block * sum(self._widths(side)) * 2


# ---- compile-time fitting: NeuralDict (k-means initialisation, then a gradient loop through matching pursuit) ----


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


def renorm(atoms: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """The paper's ReNorm: every atom scaled to unit l2 norm (a vanishing atom takes `fallback`'s row)."""
    norms = atoms.norm(dim=1, keepdim=True)
    good = norms.squeeze(1) > 1e-8
    out = fallback.clone()
    out[good] = atoms[good] / norms[good]
    return out


def pursuit_residual(x: torch.Tensor, atoms: torch.Tensor, sparsity: int) -> torch.Tensor:
    """x - atoms^T r(x, atoms, s) with r found by matching pursuit, differentiable in the atoms (the chosen
    indices are not; the coefficients <R, d> and the residual updates are): the paper's eq. 8 inside."""
    residual = x
    for _ in range(sparsity):
        corr = residual @ atoms.T
        best = corr.detach().abs().argmax(dim=-1, keepdim=True)
        residual = residual - corr.gather(-1, best) * atoms[best.squeeze(-1)]
    return residual


def diversity(atoms: torch.Tensor) -> torch.Tensor:
    """The paper's eq. 10: ||I - D D^T||_F^2 / N^2 (rows of `atoms` are the atoms)."""
    n = atoms.shape[0]
    return (torch.eye(n) - atoms @ atoms.T).pow(2).sum() / n**2


def neural_dict(
    x: torch.Tensor,
    atoms: int,
    sparsity: int,
    *,
    epochs: int = 10,
    batch: int = 1024,
    learning_rate: float = 0.01,
    kmeans_iterations: int = 10,
    seed: int = 0,
    init: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """NeuralDict (the paper's Algorithm 1, TrainNeurDict) for the rows of x [T, w]: a unit-norm dictionary
    [atoms, w] initialised at k-means centroids, then `epochs` passes of mini-batch Adam on
    L = L_MSE + beta * L_div (eqs. 8, 10, 11; beta = min(0.1 * L_MSE / L_div of the last batch, 1)) with ReNorm
    after every step. Returns the dictionary and the relative MSE (sum |x - D r|^2 / sum |x|^2 over all of x)
    before and after the gradient loop."""
    generator = torch.Generator().manual_seed(seed)
    x = x.float()
    if x.shape[0] < atoms:  # too few calibration vectors: repeat them (k-means re-seeds duplicates anyway)
        x = x.repeat(-(-atoms // x.shape[0]), 1)
    rand = torch.randn(atoms, x.shape[1], generator=generator)
    rand = rand / rand.norm(dim=1, keepdim=True)
    start = kmeans(x, atoms, kmeans_iterations, generator) if init is None else init.float()
    dictionary = renorm(start, rand)
    energy = x.pow(2).sum().clamp_min(1e-30)

    def relative_mse(d: torch.Tensor) -> float:
        with torch.no_grad():
            return float(sum(pursuit_residual(part, d, sparsity).pow(2).sum() for part in x.split(8192)) / energy)

    history = [relative_mse(dictionary)]
    if epochs == 0 or learning_rate == 0:
        return dictionary, history
    weight = torch.nn.Parameter(dictionary.clone())
    optimizer = torch.optim.Adam([weight], lr=learning_rate)
    beta = None
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(x.shape[0], generator=generator)
            for lo in range(0, x.shape[0], batch):
                rows = x[order[lo : lo + batch]]
                mse = pursuit_residual(rows, weight, sparsity).pow(2).sum(-1).mean()
                div = diversity(weight)
                if beta is None:  # first batch: the coefficient from this batch's own values
                    beta = min(0.1 * mse.item() / max(div.item(), 1e-30), 1.0)
                loss = mse + beta * div
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                beta = min(0.1 * mse.item() / max(div.item(), 1e-30), 1.0)  # the adaptive coefficient (eq. 11)
                with torch.no_grad():
                    weight.copy_(renorm(weight, dictionary))
    history.append(relative_mse(weight.detach()))
    return weight.detach().clone(), history
