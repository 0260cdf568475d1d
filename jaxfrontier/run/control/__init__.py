"""Run control: what keeps a run safe to start, stop and restart.

  workdir_lock  one run per workdir (a lease renewed by a thread; dead holders taken over)
  preemption    SIGTERM / SIGUSR1 -> a stop every process agrees on, after a committed checkpoint
  interrupt     the first Ctrl-C stops like SIGTERM, a second at once
  watchdog      a hung step: every thread's stack to <workdir>/hang/, exit 5
  disk          a full disk as one line naming the file, the free space and the fix
"""
