import subprocess, os
from slurm_cluster import job_env, sbatch

def test_probe(slurm, tmp_path):
    for name, body in [('kill9', 'if [ $SLURM_PROCID = 1 ]; then sleep 1; kill -9 $$; fi; sleep 20'),
                       ('exit5', 'if [ $SLURM_PROCID = 1 ]; then sleep 1; exit 5; fi; sleep 20'),
                       ('stop_then_exit5', 'if [ $SLURM_PROCID = 1 ]; then kill -STOP $$; fi; sleep 2; exit 5')]:
        out = str(tmp_path / f'{name}.out')
        script = f"srun --kill-on-bad-exit=1 bash -c '{body}'; echo SRUN_STATUS $?\n"
        status, text = sbatch(job_env(slurm), '--nodes=1', '--ntasks-per-node=2', '--time=5', f'--output={out}', f'--wrap={script}', timeout_s=120)
        with open(f'/tmp/ftprobe/{name}.txt', 'w') as f:
            f.write(f'{status}\n{text}\n' + open(out).read())
