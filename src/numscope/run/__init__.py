"""Training runs of language models under a precision plan, for the demo, the studies and users' own models.

``corpus`` reads the default Wikipedia corpus (CC BY-SA 4.0) or the user's text files and splits them;
``tokenizer`` trains and caches a WordPiece tokenizer on the training split; ``model`` builds a small
``BertForMaskedLM`` from a config; ``data`` turns documents into masked batches and scores a model on a fixed
set of masked tokens (``load_run_data``: corpus to blocks in one call); ``objectives`` are masked and causal
LM; ``sources`` resolves ``--model`` and the data settings; ``config`` holds what a run is (its plan,
optimisation settings, data, result); ``loop`` trains one run, resumable and logged; ``pool`` trains
several side by side in worker processes; ``folders`` checks output folders and the settings a run folder
recorded; ``runner`` runs ``analyze`` and ``train`` into a run folder (``numscope analyze``/``train``);
``compare`` reads finished run folders and says whether a loss gap between them means anything. Names are
resolved lazily so that reading the corpus does not import torch.
"""

from __future__ import annotations

from numscope._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CORPUS_ATTRIBUTION": "numscope.run.corpus",
    "CORPUS_INSTALL": "numscope.run.corpus",
    "CorpusError": "numscope.run.corpus",
    "CorpusNotFoundError": "numscope.run.corpus",
    "corpus_hash": "numscope.run.corpus",
    "default_corpus_path": "numscope.run.corpus",
    "load_corpus": "numscope.run.corpus",
    "split_corpus": "numscope.run.corpus",
    "DEFAULT_VOCAB_SIZE": "numscope.run.tokenizer",
    "SPECIAL_TOKENS": "numscope.run.tokenizer",
    "TokenizerInfo": "numscope.run.tokenizer",
    "default_cache_dir": "numscope.run.tokenizer",
    "load_or_train_tokenizer": "numscope.run.tokenizer",
    "train_tokenizer": "numscope.run.tokenizer",
    "ModelConfig": "numscope.run.model",
    "bert_mlm_from_config": "numscope.run.model",
    "make_bert_mlm": "numscope.run.model",
    "IGNORE_INDEX": "numscope.run.data",
    "MLMEvaluation": "numscope.run.data",
    "batches": "numscope.run.data",
    "evaluate_mlm": "numscope.run.data",
    "load_or_make_blocks": "numscope.run.data",
    "make_blocks": "numscope.run.data",
    "mlm_mask": "numscope.run.data",
    "num_batches": "numscope.run.data",
    "load_run_data": "numscope.run.data",
    "BUILTIN_MODELS": "numscope.run.sources",
    "DataSettings": "numscope.run.sources",
    "ModelSource": "numscope.run.sources",
    "WorkflowError": "numscope.errors",
    "resolve_model": "numscope.run.sources",
    "resolve_workload": "numscope.run.sources",
    "Workload": "numscope.run.sources",
    "settle_tokenizer": "numscope.run.sources",
    "load_tokenizer_file": "numscope.run.tokenizer",
    "analyze": "numscope.run.runner",
    "train": "numscope.run.runner",
    "evaluate": "numscope.run.runner",
    "prepare": "numscope.run.runner",
    "OutputPathError": "numscope.run.folders",
    "check_output_folder": "numscope.run.folders",
    "check_output_file": "numscope.run.folders",
    "LOSS_SCALING": "numscope.run.config",
    "RunData": "numscope.run.config",
    "RunError": "numscope.run.config",
    "RunResult": "numscope.run.config",
    "RunSpec": "numscope.run.config",
    "SensitivitySettings": "numscope.run.config",
    "TrainConfig": "numscope.run.config",
    "read_result": "numscope.run.config",
    "CausalLM": "numscope.run.objectives",
    "MaskedLM": "numscope.run.objectives",
    "OBJECTIVES": "numscope.run.objectives",
    "Objective": "numscope.run.objectives",
    "get_objective": "numscope.run.objectives",
    "LOG_FIELDS": "numscope.run.loop",
    "read_log": "numscope.run.loop",
    "train_run": "numscope.run.loop",
    "RunPool": "numscope.run.pool",
    "default_jobs": "numscope.run.pool",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
