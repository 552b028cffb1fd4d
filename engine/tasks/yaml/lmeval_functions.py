"""lm-evaluation-harness's own functions for the shipped tasks whose definitions need code (HellaSwag's text
clean-up, COPA's connectives, Winogrande's partial scoring), re-exported under one module name: the task YAMLs
here name them with `!function lmeval_functions.<name>`, which lm-eval resolves beside the YAML."""
from lm_eval.tasks.hellaswag.utils import process_docs as hellaswag_process_docs  # noqa: F401
from lm_eval.tasks.super_glue.copa.utils import doc_to_choice as copa_doc_to_choice  # noqa: F401
from lm_eval.tasks.super_glue.copa.utils import doc_to_target as copa_doc_to_target  # noqa: F401
from lm_eval.tasks.super_glue.copa.utils import doc_to_text as copa_doc_to_text  # noqa: F401
from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_choice as winogrande_doc_to_choice  # noqa: F401
from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_target as winogrande_doc_to_target  # noqa: F401
from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_text as winogrande_doc_to_text  # noqa: F401
