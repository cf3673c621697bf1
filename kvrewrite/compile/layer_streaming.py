"""Running a causal LM one decoder layer at a time, with weights read lazily from safetensors shards.

The model is built once on the meta device (its shape, no weights). A module gets real weights only
while it runs (`StreamedModel.materialised`) and goes back to meta afterwards, so peak memory is about
one decoder layer plus the activations being carried, whatever the model's size. Every pass that needs
activations (statistics, sensitivity probes, verification, codec latents) runs through this one runner:
`StreamedModel.forward` (tokens in, hidden states or logits out) or, for several models side by side,
`StreamedModel.walk` zipped.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForCausalLM

from kvrewrite.adapters.base import Projections
from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.io.lazy_checkpoint import LazyCheckpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}

TensorSource = Callable[[list[str]], dict[str, torch.Tensor]]
# on_layer(index, materialised layer) -> None, or a context manager entered around that layer's runs (set
# ranks, truncate, hook); a dict the context manager yields adds keyword arguments to the layer's runs.
OnLayer = Callable[[int, nn.Module], "contextlib.AbstractContextManager[dict | None] | None"]


def empty_model(model_class_or_config, config=None) -> nn.Module:
    """A model on the meta device (parameters only; buffers such as RoPE frequencies stay real)."""
    with init_empty_weights(include_buffers=False):
        if config is None:
            model = AutoModelForCausalLM.from_config(model_class_or_config)
        else:
            model = model_class_or_config(config)
    return model.eval()


def module_prefixes(model: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules()}


@contextlib.contextmanager
def loaded(
    module: nn.Module, prefix: str, tensors: TensorSource, dtype: torch.dtype, device: torch.device
) -> Iterator[nn.Module]:
    """`module` (a part of a meta-device model, named `prefix` there) holding its checkpoint tensors for the block."""
    local = list(module.state_dict().keys())
    full = [f"{prefix}.{k}" if prefix else k for k in local]
    read = tensors(full)
    state = {k: read[name].to(device=device, dtype=dtype) for k, name in zip(local, full)}
    del read
    module.load_state_dict(state, strict=True, assign=True)
    del state
    try:
        yield module
    finally:
        # Back to meta: only the checkpoint's tensors (non-persistent buffers such as RoPE tables stay real).
        empty = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in module.state_dict().items()}
        module.load_state_dict(empty, strict=True, assign=True)


class _LayerInputsCaptured(Exception):
    """Raised by the last decoder layer's stand-in: the stock forward has prepared every layer's inputs."""


@dataclass
class LayerInputs:
    """What the stock forward passes each decoder layer besides the hidden states (mask, positions, RoPE
    tables, ...), as keyword arguments, for one batch shape. Sliding-window layers get their own mask and
    Gemma3's their own RoPE table, exactly as the stock model would give them."""

    per_layer: list[dict]


def _as_keywords(layer: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict]:
    """(hidden states, every other argument by name) of one decoder-layer call (GPT-2 passes some positionally)."""
    bound = inspect.signature(type(layer).forward).bind(layer, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(arguments)))  # self
    hidden_name = next(iter(arguments))
    hidden = arguments.pop(hidden_name)
    for name, param in inspect.signature(type(layer).forward).parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
        elif param.kind is inspect.Parameter.VAR_POSITIONAL and arguments.pop(name, ()):
            raise NotImplementedError(f"{type(layer).__name__} takes extra positional arguments")
    return hidden, arguments


class StreamedModel:
    """A meta-device model whose modules are given real weights only while they run.

    Works for every adapter's family without re-implementing its forward: the stock forward itself runs
    with the decoder layers replaced by stand-ins that record their arguments, which gives the hidden
    states entering layer 0 (token and position embeddings, scaling, ...) and every layer's mask and RoPE
    tables. Only the modules before the first layer hold weights meanwhile.
    """

    def __init__(
        self,
        skeleton: nn.Module,
        adapter,
        tensors: TensorSource,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ):
        self.skeleton, self.adapter, self.tensors = skeleton, adapter, tensors
        self.dtype, self.device = dtype, torch.device(device)
        self.prefixes = module_prefixes(skeleton)
        self.layers = adapter.decoder_layers(skeleton)
        self.layer_index = {id(layer): i for i, layer in enumerate(self.layers)}
        # Non-persistent buffers (RoPE frequencies, embedding scales) are real: they go where compute runs.
        for module in skeleton.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device.type != "meta" and buf.device != self.device:
                    module._buffers[name] = buf.to(self.device)
        self.final_modules = adapter.final_modules(skeleton)
        self.prelude = self._prelude_modules()
        self._inputs: dict[tuple, LayerInputs] = {}  # batch shape -> layer inputs
        # Parameters holding real data right now, and the most there ever were (a memory check for tests).
        self.resident_params = 0
        self.peak_resident_params = 0

    def _prelude_modules(self) -> list[nn.Module]:
        """Modules with weights outside the decoder layers, the final norm(s) and the LM head (embeddings, learned
        positions, input projections): what the stock forward runs before the first layer."""
        skip = {id(m) for part in (*self.layers, *self.final_modules) for m in part.modules()}
        skip.add(id(self.skeleton.get_output_embeddings()))
        picked: list[tuple[str, nn.Module]] = []
        for name, module in self.skeleton.named_modules():
            if id(module) in skip or any(name.startswith(p + ".") for p, _ in picked):
                continue
            if next(module.parameters(recurse=False), None) is not None:
                picked.append((name, module))
        return [module for _, module in picked]

    def name_of(self, module: nn.Module) -> str:
        return self.prefixes[id(module)]

    @contextlib.contextmanager
    def materialised(self, module: nn.Module) -> Iterator[nn.Module]:
        """Give `module` its weights (read now, cast to the compute dtype) for the duration of the block."""
        with loaded(module, self.name_of(module), self.tensors, self.dtype, self.device):
            count = sum(p.numel() for p in module.parameters())
            self.resident_params += count
            self.peak_resident_params = max(self.peak_resident_params, self.resident_params)
            try:
                yield module
            finally:
                self.resident_params -= count

    def layer(self, idx: int):
        return self.materialised(self.layers[idx])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_batches([tokens])[0]

    def embed_batches(self, batches: list[torch.Tensor]) -> list[torch.Tensor]:
        """The hidden states entering the first layer for several token batches, reading the embeddings once."""
        with contextlib.ExitStack() as stack:
            for module in self.prelude:
                stack.enter_context(self.materialised(module))
            hidden = []
            for tokens in batches:
                h, inputs = self._run_prelude(input_ids=tokens.to(self.device))
                self._inputs[tuple(tokens.shape)] = inputs
                hidden.append(h)
            return hidden

    def layer_inputs(self, hidden: torch.Tensor) -> LayerInputs:
        """Every layer's mask, positions and RoPE tables for a batch of full windows (no padding, no cache)."""
        shape = tuple(hidden.shape[:2])
        if shape not in self._inputs:
            # Same forward with placeholder embeddings: the inputs depend on the shape only, and the token
            # embedding matrix (often the largest tensor) need not be read.
            embedding = self.skeleton.get_input_embeddings()
            with contextlib.ExitStack() as stack:
                for module in self.prelude:
                    if module is not embedding:
                        stack.enter_context(self.materialised(module))
                zeros = torch.zeros(*shape, embedding.embedding_dim, dtype=self.dtype, device=self.device)
                self._inputs[shape] = self._run_prelude(inputs_embeds=zeros)[1]
        return self._inputs[shape]

    def _run_prelude(self, **model_inputs) -> tuple[torch.Tensor, LayerInputs]:
        """Run the stock forward up to the last layer's call with recording stand-ins for the layers."""
        calls: list[tuple[torch.Tensor, dict]] = []
        last = len(self.layers) - 1

        def stand_in(layer: nn.Module, idx: int):
            def forward(*args, **kwargs):
                hidden, arguments = _as_keywords(layer, args, kwargs)
                calls.append((hidden, arguments))
                if idx == last:
                    raise _LayerInputsCaptured
                return hidden

            return forward

        for idx, layer in enumerate(self.layers):
            layer.forward = stand_in(layer, idx)
        try:
            self.skeleton(**model_inputs, use_cache=False)
        except _LayerInputsCaptured:
            pass
        finally:
            for layer in self.layers:
                del layer.forward
        if len(calls) != len(self.layers):
            raise RuntimeError(
                f"the {type(self.skeleton).__name__} forward called {len(calls)} of {len(self.layers)} decoder layers"
            )
        return calls[0][0], LayerInputs([arguments for _, arguments in calls])

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, inputs: LayerInputs, **overrides) -> torch.Tensor:
        """One decoder layer on a batch, with the arguments the stock forward gives it (`overrides` replace some)."""
        arguments = {**inputs.per_layer[self.layer_index[id(layer)]], "use_cache": False, **overrides}
        out = layer(hidden, **arguments)
        return out[0] if isinstance(out, tuple) else out

    def walk(
        self, hidden: MutableSequence[torch.Tensor] | MutableMapping, on_layer: OnLayer | None = None, **layer_kwargs
    ) -> Iterator[int]:
        """Carry the hidden states in `hidden` (a list or dict, its entries replaced in place) through every decoder
        layer, in order; yields each layer's index once it ran on every entry and gave its weights back.

        The loop of every layer-streamed pass: one layer holds weights at a time, each entry runs with the mask,
        positions and RoPE tables the stock forward gives it (`layer_inputs`, by shape), `layer_kwargs` and
        on_layer's keywords replace some. Entries added to a dict during a layer start at the next one. Walks of
        several models zipped run in lockstep (each yields with no weights held).
        """
        for h in hidden.values() if isinstance(hidden, MutableMapping) else hidden:
            self.layer_inputs(h)  # before any layer holds weights (the prelude may be read)
        for idx, layer in enumerate(self.layers):
            with self.materialised(layer), contextlib.ExitStack() as stack:
                hook = on_layer(idx, layer) if on_layer is not None else None
                extra = stack.enter_context(hook) if hook is not None else None
                arguments = {**layer_kwargs, **extra} if isinstance(extra, Mapping) else layer_kwargs
                for key in list(hidden.keys()) if isinstance(hidden, MutableMapping) else range(len(hidden)):
                    hidden[key] = self.run_layer(layer, hidden[key], self.layer_inputs(hidden[key]), **arguments)
            yield idx

    def forward(
        self,
        batches: torch.Tensor | list[torch.Tensor],
        *,
        on_layer: OnLayer | None = None,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        progress: Callable[[], None] | None = None,
        **layer_kwargs,
    ) -> torch.Tensor | list[torch.Tensor]:
        """The whole model on token batches ([B, T] each, a tensor or a list), one decoder layer at a time.

        Returns the last layer's hidden states per batch, or with `head` head(logits) per batch (final norm(s)
        and LM head materialised once). on_layer and layer_kwargs as in `walk`; progress() after every layer.
        A tensor in gives a tensor out, a list a list.
        """
        single = isinstance(batches, torch.Tensor)
        hidden = self.embed_batches([batches] if single else list(batches))
        for _ in self.walk(hidden, on_layer, **layer_kwargs):
            if progress is not None:
                progress()
        if head is not None:
            with self.output_head() as logits:
                hidden = [head(logits(h)) for h in hidden]
        return hidden[0] if single else hidden

    @contextlib.contextmanager
    def output_head(self) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """final norm(s) + LM head, materialised once for several hidden-state streams."""
        head = self.skeleton.get_output_embeddings()
        config = self.skeleton.config
        with contextlib.ExitStack() as stack:
            for module in (*self.final_modules, head):
                stack.enter_context(self.materialised(module))

            def logits(hidden: torch.Tensor) -> torch.Tensor:
                for module in self.final_modules:
                    hidden = module(hidden)
                return self.adapter.finish_logits(config, head(hidden))

            yield logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.output_head() as head:
            return head(hidden)


@dataclass
class SourceModel:
    """The original checkpoint: its config, adapter, lazily read tensors and a meta-device skeleton."""

    directory: Path
    config: object
    adapter: object
    checkpoint: LazyCheckpoint
    skeleton: nn.Module

    @classmethod
    def open(cls, directory: Path, config, adapter) -> "SourceModel":
        return cls(Path(directory), config, adapter, LazyCheckpoint(directory), empty_model(config))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.skeleton.parameters())

    def tensor_name(self, name: str) -> str:
        """Where a parameter lives in the checkpoint (a tied lm_head is stored as the embedding)."""
        if name in self.checkpoint:
            return name
        if getattr(self.config, "tie_word_embeddings", False) and name == self.output_embedding_name():
            return self.input_embedding_name()
        raise CorruptCheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")

    def input_embedding_name(self) -> str:
        return module_prefixes(self.skeleton)[id(self.skeleton.get_input_embeddings())] + ".weight"

    def output_embedding_name(self) -> str:
        return module_prefixes(self.skeleton)[id(self.skeleton.get_output_embeddings())] + ".weight"

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        stored = {name: self.tensor_name(name) for name in names}
        tensors = self.checkpoint.read(sorted(set(stored.values())))
        return {name: tensors[where] for name, where in stored.items()}

    def attention_prefix(self, layer_idx: int) -> str:
        layer = self.adapter.decoder_layers(self.skeleton)[layer_idx]
        return module_prefixes(self.skeleton)[id(self.adapter.attention(layer))]

    def streamed(self, dtype: torch.dtype = torch.float32, device: str = "cpu") -> StreamedModel:
        return StreamedModel(self.skeleton, self.adapter, self.read, dtype, device)

    def attention_weights(self, layer_idx: int) -> tuple[Projections, dict[str, torch.Tensor]]:
        """One layer's attention in float64, read from the shards: its q/k/v/o projections (split where stored
        fused) and the tensors the compressed attention keeps unchanged (q/k norms)."""
        attn = self.adapter.attention(self.adapter.decoder_layers(self.skeleton)[layer_idx])
        with loaded(attn, self.attention_prefix(layer_idx), self.read, torch.float64, torch.device("cpu")):
            # Plain tensors outlive the block: going back to meta swaps the module's parameters, not these.
            return self.adapter.projections(attn), self.adapter.kept_attention_state(attn)
