"""The model card says what the checkpoint's own key modes and codec do at decode time."""

from kvrewrite.publish.model_card import run_time_cost
from kvrewrite.spec import CompressionSpec, LayerSpec


def _spec(modes: list[str], codec: dict | None = None) -> CompressionSpec:
    layers = [LayerSpec(mode, [4, 4], [4, 4], [list(range(4))] * 2 if mode == "freq" else None) for mode in modes]
    return CompressionSpec(
        "src", None, "llama", len(modes), 4, 2, 8, "optimal", "sensitivity", 0.5, layers, kv_codec=codec
    )


def test_latent_card_says_keys_are_rebuilt_every_step():
    text = run_time_cost(_spec(["latent", "latent"]))
    assert "rebuild every cached key" in text and "nothing extra" not in text


def test_each_mode_and_codec_is_described():
    text = run_time_cost(_spec(["freq", "post-rope"], codec={"name": "int4", "params": {}}))
    assert "`freq` layers do nothing extra" in text
    assert "`post-rope` layers project" in text
    assert "`int4` codec cache decodes its whole coded store" in text
    assert "latent" not in text
