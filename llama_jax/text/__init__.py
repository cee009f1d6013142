"""Text handling: the checkpoint's tokenizer and its special tokens (`tokenizer`), streaming detokenization that never
shows a broken character or half a stop string (`detokenize`), and chat templates (`chat_template`)."""
