"""Optional integrations with other libraries: ``transformers`` (the "cudnn_moe" experts implementation).
Each is imported explicitly (``import cudnn_moe.integrations.transformers``); ``import cudnn_moe`` imports
none of them."""
