"""``python -P -m fxquant.hf > docs/hf_configs.md``: the table of every Hugging Face quantization
config and field, for the installed transformers."""

import transformers

from fxquant.hf import docs_table, transformers_fields

print(docs_table(transformers_fields(), transformers.__version__), end="")
