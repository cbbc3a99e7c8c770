"""bulkgen from Python: a queued, resumable job, and a quick in-memory run.

    python examples/python_api.py            # the default model, on the CPU, about a minute
"""

import bulkgen

prompts = ["Name three rivers in Europe.", "What is the boiling point of water?", "Write a haiku about stone."]

# A job in the queue (the default SQLite database, or BULKGEN_DB): resumable, exported in input order.
job = bulkgen.submit(prompts, chat=True, max_new_tokens=48, name="python example")
bulkgen.run([job.id], progress=True)
print(job.status()["counts"])
for row in job.results().select(["row", "prompt", "output"]).to_pylist():
    print(row["row"], row["prompt"], "->", row["output"].strip()[:80])

# In memory, no database: for notebooks and tests.
for out in bulkgen.generate(prompts[:2], chat=True, max_new_tokens=24):
    print(out["finish_reason"], out["output"].strip()[:80])
