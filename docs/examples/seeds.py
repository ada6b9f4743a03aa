"""The seed pages' demo output (docs/seeds/): each experiment of ``python -m cudamem demo``
as the command line prints it, one section per experiment key (``=== seed000-losses ===``).

On a machine without a GPU the experiments that need one print their SKIP line; the pages
show the GPU run's sections, and the card they ran on (``docs/output/card-gpu.txt``).
"""

from cudamem.demo import experiments, render_experiment, render_summary, run_demo

results = []
for key, _ in experiments():
    print(f"=== {key} ===")
    (result,) = run_demo(only=[key])
    results.append(result)
    print(render_experiment(result))
print("=== summary ===")
print(render_summary(results))
