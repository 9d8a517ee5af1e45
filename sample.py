"""Generate text from a trained run. Only the samples go to stdout.

python sample.py out_dir=RUN start="ROMEO:" num_samples=3 max_new_tokens=500
python sample.py out_dir=RUN start=FILE:prompt.txt
python sample.py out_dir=RUN start="'To be, or not'"   # quote prompts with commas, spaces or symbols
"""

import sys

import hydra
from omegaconf import DictConfig

from training.cli import exit_on_user_error, explain_unparsable_overrides
from training.sampling import sample
from training.schema import register_schemas

register_schemas()


@hydra.main(version_base="1.3", config_path="configs", config_name="sample")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        for text in sample(cfg):
            print(text)
            print("---------------")


if __name__ == "__main__":
    explain_unparsable_overrides(sys.argv[1:])
    main()
