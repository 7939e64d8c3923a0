from ear_jax import Memory
memory = Memory.open("ear_memory")  # a new memory there (MiniLM, hybrid first stage, ear_safe), or the one saved before
if not len(memory):  # each add is durable at once (SQLite)
    memory.add(["Alice: I adopted a cat named Luna.", "Bob: I started learning the violin.", "Alice: Luna sleeps on my keyboard.",
                "Bob: My sister lives in Lisbon.", "Alice: I work as a nurse in Boston.", "Bob: I ran a marathon last spring."])
for question, gold in [("What is Alice's cat called?", {"m0"}), ("Where does Bob's sister live?", {"m3"})] * 2:
    cite = lambda key, view: [1.0 if i in gold else -1.0 for i in view.ids]  # your LLM's citations (LLMCritic)
    answer = memory.recall(question, cite, k=3)  # T Explorer rounds = ONE training query; a step per 4 questions
memory.save()  # the learner (Orbax); a second run goes on learning from here
print(memory.search("Who has a cat?", k=2).texts)  # adapter-only: no critic, no learning
memory.close()
