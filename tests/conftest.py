import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # for `import dist_utils`
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
