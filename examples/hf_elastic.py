# A Hugging Face Trainer script: docs/INTEGRATIONS.md shows its diff to examples/hf_elastic.py.
from slurm_elastic.train import install_stop_handler
install_stop_handler()  # first: a stop request during the slow imports must not kill the task
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from slurm_elastic.train.integrations.hf import ElasticTrainer, elastic_setup

g = torch.Generator().manual_seed(0)
ids = torch.randint(0, 64, (256, 16), generator=g)
train_set = [{"input_ids": row, "labels": row} for row in ids]

job = elastic_setup(seed=0, default_batch=32, lr_scaling="sqrt")  # before TrainingArguments
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # no dropout: exact resumes
args = TrainingArguments(output_dir="hf-out", num_train_epochs=2, learning_rate=3e-4, per_device_train_batch_size=16,
                         lr_scheduler_type="cosine", warmup_steps=2, save_strategy="no", report_to=[], use_cpu=True)
trainer = ElasticTrainer(job=job, model=model, args=args, train_dataset=train_set)
trainer.train()
