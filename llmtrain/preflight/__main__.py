import runpy

runpy.run_module("llmtrain.run.preflight", run_name="__main__", alter_sys=True)
