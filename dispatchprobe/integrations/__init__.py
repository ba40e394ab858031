"""dispatchprobe inside the training stacks people already use: ``transformers.Trainer``
(:mod:`.transformers`).  Each module imports its framework; nothing here is imported by the package."""
