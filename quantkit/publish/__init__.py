"""Publishing artifacts: `push` uploads finished artifacts to a Hugging Face Hub repo as one atomic commit
(push.py), after checking them complete (contents.py), through huggingface_hub with timeouts, retries and
one-line errors (hub.py), with a model card whose table grows push by push (card.py, plot.py) from what each
artifact's record holds (record.py: `quantkit eval --record` puts the metrics there)."""
from .card import card_files, row_for
from .contents import placement
from .push import PushResult, push
from .record import write_metrics

__all__ = ["PushResult", "card_files", "placement", "push", "row_for", "write_metrics"]
