"""The MLA compiler: the multi-head latent form of a per-head model, its allocation, refits and distillation, and
its export as a stock DeepSeek-V3 checkpoint (`kvrewrite export-mla`, docs/serving.md)."""
