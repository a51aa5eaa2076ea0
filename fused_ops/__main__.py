"""``python -m fused_ops``: print what this build of fused_ops is and sees."""

import json

import fused_ops

if __name__ == "__main__":
    print(json.dumps(fused_ops.info(), indent=2))
