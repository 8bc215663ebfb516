"""The engine-free parts of the RLHF loop: tasks with verifiable rewards and their tokenizer
(``tasks``), reward functions and the ``module:function`` plug-in point (``rewards``), the GRPO/PPO
math as plain torch functions (``algorithms``) and the typed run config with its fit check
(``config``). Nothing here starts a process, touches a device or imports an engine."""
