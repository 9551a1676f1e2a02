"""Op sets that run the model's matrix products; `cpu` is numpy and the numerics reference."""
