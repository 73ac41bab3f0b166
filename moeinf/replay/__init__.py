"""Replaying an Azure LLM inference trace against a model: workloads built from the trace and real
prompts (`workload`), timed runs in-process or against a server (`runner`), summaries and plots
(`report`). The `moeinf replay` command ties them together."""
