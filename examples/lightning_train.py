"""numscope inside a Lightning Trainer: observe a LightningModule's GEMMs while it trains.

    python examples/lightning_train.py [OUT]    # writes the analysis into OUT/analysis

``NumscopeLightningCallback`` attaches to the module ``training_step`` calls (here ``self.model``), steps
after every optimizer step and writes the analysis when fitting ends; ``numscope recommend OUT/analysis``
then recommends a plan, which ``NumscopeLightningCallback(plan="plan.yaml", observe=False)`` trains under.
"""

import sys
from pathlib import Path

import lightning
import torch
from transformers import BertConfig, BertForMaskedLM

from numscope.integrations.lightning import NumscopeLightningCallback

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/lightning")


class MaskedLM(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = BertForMaskedLM(BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=64))  # fmt: skip

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=2e-3)


ids = torch.randint(5, 512, (64, 32), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": ids[i], "labels": ids[i]} for i in range(len(ids))]
callback = NumscopeLightningCallback(OUT / "analysis", candidates=["bf16", "fp8_e4m3", "mxfp8_e4m3"], every=4)
trainer = lightning.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, callbacks=[callback])  # fmt: skip
trainer.fit(MaskedLM(), torch.utils.data.DataLoader(data, batch_size=8))
print(f"analysis of steps {callback.analysis.steps}: {OUT / 'analysis'} (next: numscope recommend it)")
