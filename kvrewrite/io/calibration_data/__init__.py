"""Calibration and evaluation text: Wikipedia and news (shipped with gensim), model-generated synthetic text, user files."""

from kvrewrite.io.calibration_data.corpus import (
    EVALUATION_TEXTS,
    NAMED_SOURCES,
    calibration_token_sequences,
    evaluation_documents,
    evaluation_token_sequences,
    load_text_documents,
)
from kvrewrite.io.calibration_data.news import news_split
from kvrewrite.io.calibration_data.synthetic import GenerationSettings, seed_prompts, synthetic_texts
from kvrewrite.io.calibration_data.wiki import WikiArticle, wiki_articles, wiki_split

__all__ = [
    "EVALUATION_TEXTS",
    "evaluation_documents",
    "news_split",
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
