"""logprob-forensics: re-score an inference engine's exact tokens with a reference model and find the lies.

Importing `lpf` is cheap: no torch, no transformers. Heavy modules load when a command needs them.
"""

__version__ = "0.1.0"
