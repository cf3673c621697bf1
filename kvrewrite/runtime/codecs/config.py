"""Which KV codec a model uses, and its parameters: parsed from `--kv-codec NAME[:key=value,...]`.

The parameters, their defaults and their checks belong to the codec classes (looked up in the registry).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.codecs.registry import NONE, codec_class

if TYPE_CHECKING:
    from kvrewrite.runtime.codecs.base import LayerCodec


@dataclass(frozen=True)
class CodecConfig:
    name: str
    params: dict = field(default_factory=dict)

    @property
    def codec_class(self) -> type[LayerCodec]:
        return codec_class(self.name)

    @property
    def block_tokens(self) -> int:
        return int(self.params["group_size"])

    @property
    def residual(self) -> int:
        return int(self.params["residual"])

    def to_dict(self) -> dict:
        return {"name": self.name, "params": dict(self.params)}

    def describe(self) -> str:
        defaults = self.codec_class.defaults
        changed = [f"{k}={v}" for k, v in self.params.items() if defaults.get(k) != v]
        return self.name + (":" + ",".join(changed) if changed else "")

    @classmethod
    def from_dict(cls, data: dict) -> "CodecConfig":
        return make_codec_config(data["name"], data.get("params", {}))


def make_codec_config(name: str, overrides: dict | None = None, option: str = "`kv_codec`") -> CodecConfig:
    codec = codec_class(name, option)
    params = codec.parse_params(overrides or {})
    codec.validate(params)
    return CodecConfig(name, params)


def parse_codec(text: str | None, option: str = "`kv_codec`") -> CodecConfig | None:
    """`int4`, `gear:bits=4,rank=4`, `none` (-> None). `option` names the setting in errors (e.g. `--kv-codec`)."""
    if text is None or text == NONE or text == "":
        return None
    name, _, rest = str(text).partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgumentError(f"codec parameter {item!r} must be key=value (e.g. int4:group_size=64)")
        overrides[key.strip()] = value.strip()
    return make_codec_config(name.strip(), overrides, option)
