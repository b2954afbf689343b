"""Publishing artifacts: `push` uploads finished artifacts to a Hugging Face Hub repo as one atomic commit
(push.py), after checking them complete (contents.py), through huggingface_hub with timeouts, retries and
one-line errors (hub.py)."""
from .push import PushResult, push

__all__ = ["PushResult", "push"]
