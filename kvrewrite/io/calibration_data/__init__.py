"""Calibration and evaluation text: Wikipedia (shipped with gensim), model-generated synthetic text, user files."""

from kvrewrite.io.calibration_data.corpus import (
    NAMED_SOURCES,
    calibration_token_sequences,
    evaluation_token_sequences,
    load_text_documents,
)
from kvrewrite.io.calibration_data.synthetic import GenerationSettings, seed_prompts, synthetic_texts
from kvrewrite.io.calibration_data.wiki import WikiArticle, wiki_articles, wiki_split

__all__ = [
    "NAMED_SOURCES",
    "GenerationSettings",
    "WikiArticle",
    "calibration_token_sequences",
    "evaluation_token_sequences",
    "load_text_documents",
    "seed_prompts",
    "synthetic_texts",
    "wiki_articles",
    "wiki_split",
]
